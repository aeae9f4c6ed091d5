"""The run's shared retrieval service: ONE Ray actor that serves the corpus to every sampler.

`runtime/roles.py:Roles` starts it before the samplers (and stops it, or replaces it when its actor died):
when `env.retriever = service` and `env.retriever_url` is unset, the actor loads (or builds once) the index
and serves it from a thread in its own process, and its URL (and token) go into `data["env"]`, the config
dict every sampler is built from. This module holds the role, the corpus it serves and where it binds.

What it serves: `env.corpus`, or for `synthetic_kb` the generated KB's passages, written once to
`run_dir/retrieval/corpus.jsonl` (rewritten only when they change, so a resumed run reuses its index). The
index goes beside the corpus (`<corpus>.index/`), or under `run_dir/retrieval/` when that folder is not
writable. Binding: loopback on a one-node Ray instance; on a cluster the actor's node address, with a token
(`env.retriever_token`, `$TREEOPSD_RETRIEVER_TOKEN`, or a fresh random one handed to the samplers).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

from actors.envs.retrieval_index import open_index
from actors.envs.retrieval_server import RetrievalServer, resolve_token
from configs.schema import Config, ConfigError
from runtime.remote import host_class
from storage.durable import write_atomic
from system.roles import RetrievalRole

log = logging.getLogger(__name__)


class RetrievalService:
    """The role: the corpus's index served over HTTP from a thread of this process."""

    def __init__(
        self, corpus: str, kind: str, index_dir: str | None, encoder: str | None, host: str, token: str | None
    ) -> None:
        host = ray.util.get_node_ip_address() if host == "node" else host
        self.server = RetrievalServer(None, host=host, port=0, token=token)
        opened = open_index(corpus, kind, index_dir, encoder)
        self.server.index = opened.index
        self.server.start()
        self.info = {"url": self.server.url, "passages": len(opened.index), "reused": opened.reused}
        log.info("retrieval service: %s", self.info)

    def url(self) -> str:
        return self.server.url

    def describe(self) -> dict[str, Any]:
        return dict(self.info)

    def stop(self) -> None:
        """Closes the server: later searches are refused (the samplers' tool-error path)."""
        self.server.stop()


RetrievalActor = host_class("RetrievalActor", RetrievalRole, RetrievalService)  # runtime/remote.py


def service_corpus(cfg: Config) -> tuple[Path, Path | None]:
    """(corpus file, index folder or None for the default beside it) that the run's service serves."""
    e, own = cfg.env, Path(cfg.run.run_dir) / "retrieval"
    if e.corpus is not None:
        corpus = Path(e.corpus)
        if not corpus.is_file():
            raise ConfigError(
                f"env.corpus = {e.corpus!r} is invalid: no such file (the retrieval service reads it)"
            )
        return corpus, None if os.access(corpus.parent, os.W_OK) else own / "index"
    if e.name != "synthetic_kb":
        raise ConfigError(f"env.corpus is unset: env.retriever = service for {e.name} needs a corpus file")
    from actors.envs.synthetic_kb import KBConfig, generate_kb

    passages = generate_kb(KBConfig(seed=e.seed)).passages()
    rows = (json.dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False) for p in passages)
    data = "".join(r + "\n" for r in rows).encode()
    corpus = own / "corpus.jsonl"
    if not corpus.is_file() or corpus.read_bytes() != data:
        own.mkdir(parents=True, exist_ok=True)
        write_atomic(corpus, data)
    return corpus, None


def _bind(cfg: Config) -> tuple[str, str | None]:
    """(host, token): loopback on one node; the actor's node address and a token on a cluster."""
    token = resolve_token(cfg.env.retriever_token)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return "127.0.0.1", token
    return "node", token or secrets.token_urlsafe(24)


@contextmanager
def local_retrieval(cfg: Config) -> Iterator[Config]:
    """Work outside a run (evaluation before or after training, `treeopsd eval`) with `env.retriever =
    service` and no URL: the same service over the same corpus, on loopback in this process, for as long
    as the block runs; yields the config pointing at it (or `cfg` itself when no service is needed)."""
    e = cfg.env
    if e.retriever != "service" or e.retriever_url is not None:
        yield cfg
        return
    corpus, index_dir = service_corpus(cfg)
    opened = open_index(str(corpus), e.index, None if index_dir is None else str(index_dir), e.encoder)
    server = RetrievalServer(opened.index, host="127.0.0.1", port=0, token=None).start()
    try:
        yield cfg.model_copy(update={"env": e.model_copy(update={"retriever_url": server.url})})
    finally:
        server.stop()
