"""One builder of the roles for both wirings: `make_store`, `make_sampler`, `make_backup`, `make_learner`, and
the one model loader (`load_model`). runtime/local.py calls them in one process with the store object and the
in-memory weight channel; on Ray each role's actor (its host class is here) calls the same function with its
links (a store client, the ZeroMQ publisher or subscriber), so a setting applied in one wiring is applied in
the other. A Ray worker imports the module of its actor's class: nothing heavy is imported at the top here
(torch, transformers, vLLM load inside the builders), so a restarted store or backup is up in seconds.

    learner = make_learner(cfg, model_path, store=store, weights=channel)          # runtime/local.py
    SamplerActor = host_class("SamplerActor", SamplerRole, sampler_on_ray)       # the same, in an actor
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from configs.schema import Config, parse_config
from runtime.remote import Handle, host_class
from system.interfaces import StoreClient, WeightSink, WeightSource
from system.roles import BackupRole, LearnerRole, SamplerRole, StoreRole

if TYPE_CHECKING:
    from actors.backup_worker import BackupWorker
    from actors.tree_sampler import TreeSampler
    from learner.learner import Learner
    from storage.replay_store import ReplayStore
    from system.policy import PolicyBackend


def load_model(cfg: Config, model_path: str) -> tuple[Any, Any]:
    """The learner's model (float32, `model.threads` torch threads, seeded by `run.seed`) and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, cfg.model.threads))
    torch.manual_seed(cfg.run.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def store_options(cfg: Config) -> dict[str, Any]:
    """The store's settings from the config: admission's η and the fixed batch size."""
    return {"eta": cfg.admission_eta, "batch_size": cfg.learner.batch_trees}


def make_store(directory: str, **options: Any) -> ReplayStore:
    from storage.replay_store import ReplayStore

    return ReplayStore(directory, **options)


def make_backup(cfg: Config, store: StoreClient) -> BackupWorker:
    from actors.backup_worker import BackupWorker

    return BackupWorker(store, cfg.algo)


def make_sampler(
    cfg: Config,
    model_path: str,
    index: int = 0,
    incarnation: int = 0,
    *,
    store: StoreClient | None = None,
    weights: WeightSink | None = None,
    backend: PolicyBackend | None = None,
    prefix: str | None = None,
) -> TreeSampler:
    """The sampler role; `store` and `weights` are where its trees go and where its weights come from."""
    from actors.heap import freeze_long_lived
    from actors.sampler_setup import sampler_parts
    from actors.tree_sampler import TreeSampler

    parts = sampler_parts(cfg, model_path, index, incarnation, backend)
    if prefix is not None:
        parts["prefix"] = prefix
    sampler = TreeSampler(**parts, store=store, weights=weights)
    freeze_long_lived()  # engine, model, env and index: out of every full collection (actors/heap.py)
    return sampler


def make_learner(
    cfg: Config,
    model_path: str,
    *,
    store: StoreClient | None,
    weights: WeightSource | None,
    resume: bool = False,
    sharded: bool = False,
) -> Learner:
    """The learner role (with `sharded`: one rank of the sharded learner, its process group joined); restores
    the newest checkpoint when resuming and rewinds the store to its watermark (learner/learner.py)."""
    from learner.learner import Learner
    from learner.sharded import sharded_learner

    model, tokenizer = load_model(cfg, model_path)
    make = sharded_learner if sharded else Learner
    learner = make(model, cfg, store=store, weights=weights, tokenizer=tokenizer)
    learner.start(resume)
    return learner


# ---- the same roles in their Ray actors -----------------------------------------------------------------
def backup_on_ray(data: dict[str, Any], store: Handle[StoreRole]) -> BackupWorker:
    from storage.replay_store_actor import RemoteStore

    return make_backup(parse_config(data), RemoteStore(store))


def sampler_on_ray(
    data: dict[str, Any], model_path: str, index: int, store: str, endpoint: str | None, key: Any = None
) -> TreeSampler:
    """The store comes by name, not as a handle: Ray keeps an actor handle passed to a constructor in the
    object store, which a restarted sampler (max_restarts > 0) cannot rely on (ray-project/ray #53727); a name
    is looked up again by each incarnation, which also gets a fresh RNG stream and tree-id prefix. A store
    down while Ray restarts it ends the sampler's call (`StoreUnavailable`), not the sampler."""
    import ray

    from actors.weight_subscriber import WeightSubscriber
    from runtime.store_client import StoreLink, store_unavailable

    cfg = parse_config(data)
    incarnation = int(uuid.uuid4().int % 1_000_000)
    timeout = cfg.weights.fetch_timeout_s  # a version whose chunks stall this long is given up
    sub = WeightSubscriber(endpoint, key, fetch_timeout_s=timeout) if endpoint else None
    client = StoreLink(Handle(ray.get_actor(store), StoreRole), on_lost=store_unavailable)
    prefix = f"s{index}-{uuid.uuid4().hex[:8]}"
    return make_sampler(cfg, model_path, index, incarnation, store=client, weights=sub, prefix=prefix)


def learner_on_ray(
    data: dict[str, Any],
    model_path: str,
    store: Handle[StoreRole],
    resume: bool = False,
    rank: int = 0,
    world: int = 1,
    address: tuple[str, int] | None = None,
) -> Learner:
    """The learner (or one rank of it, after joining the process group): rank 0 alone holds the store client
    and the ZeroMQ weight publisher the samplers subscribe to."""
    from learner.weight_publisher import WeightPublisher
    from storage.replay_store_actor import RemoteStore

    cfg = parse_config(data)
    if address is not None:
        from learner.device import learner_device
        from learner.distributed import init_process_group

        timeout = cfg.learner.collective_timeout_s
        init_process_group(rank, world, address[0], address[1], timeout, learner_device(cfg))
    w = cfg.weights
    publisher = WeightPublisher(w.bind_host, w.port, w.chunk_mb, w.auth) if rank == 0 else None
    client = RemoteStore(store) if rank == 0 else None
    return make_learner(
        cfg, model_path, store=client, weights=publisher, resume=resume, sharded=address is not None
    )


StoreActor = host_class("StoreActor", StoreRole, make_store)
BackupActor = host_class("BackupActor", BackupRole, backup_on_ray)
SamplerActor = host_class("SamplerActor", SamplerRole, sampler_on_ray)
LearnerActor = host_class("LearnerActor", LearnerRole, learner_on_ray)
LearnerRankActor = host_class("LearnerRankActor", LearnerRole, learner_on_ray)  # its processes by name
