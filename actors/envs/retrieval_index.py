"""The retrieval service's index: built once from a corpus file, saved, reused while the corpus is unchanged.

    opened = open_index("wiki-18.jsonl", "bm25")                  # builds wiki-18.jsonl.index/bm25/ once
    opened = open_index("wiki-18.jsonl", "bm25")                  # the next start loads it (opened.reused)
    opened = open_index(corpus, "dense", index_dir=d, encoder="/models/minilm")

Corpus files (the loaders the environments use): wiki-18 / FlashRAG JSONL ``{"id", "contents"}``
(``multihop_qa.load_corpus``; the synthetic KB is written in this form too) or BrowseComp-Plus JSONL
``{"docid", "text"}`` (``deep_research.load_documents``; ``title\\ntext`` indexed, as in ``DeepResearchEnv``).

Layout: ``<index_dir>/<kind>/`` (default ``index_dir``: ``<corpus>.index`` beside the corpus) holds the
index files and ``manifest.json``: the corpus's size, mtime and sha256, and the settings (kind, index
format, bm25s version; for dense the encoder's folder and a digest of its files' names, sizes and mtimes).

Reuse rule: the manifest's settings equal this start's, the corpus has the recorded size, and either the
same mtime or (touched, copied) the same sha256; anything else rebuilds. The hash is read only when the
mtime moved. A build goes into a temp folder beside the index and becomes visible in one rename
(``storage/durable.py:publish_directory``), so a crash mid-build leaves no half index that looks whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.envs.records import DatasetFormatError, iter_jsonl
from storage.durable import TMP_PREFIX, publish_directory, write_atomic

INDEX_KINDS = ("bm25", "dense")
INDEX_FORMAT = 1
MANIFEST = "manifest.json"


class IndexDirError(OSError):
    """The index folder cannot be read or written; names the folder."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(f"{path}: {problem}")


@dataclass
class OpenedIndex:
    index: Any  # Bm25Index or DenseIndex: search(queries, topk)
    kind: str
    directory: Path
    reused: bool
    seconds: float  # to load (reused) or to build and save


def load_service_corpus(path: str | Path) -> tuple[list[str], list[str]]:
    """(ids, texts) of a corpus file, texts as the environments index them."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"corpus file not found: {p}")
    first = next(iter_jsonl(p), None)
    if first is None:
        raise DatasetFormatError(p, "file", "no passages")
    if "contents" in first.data:
        from actors.envs.multihop_qa import load_corpus

        passages = load_corpus(p)
        return [x.id for x in passages], [x.contents for x in passages]
    if "docid" in first.data:
        from actors.envs.deep_research import load_documents

        docs = load_documents(p)
        return [d.docid for d in docs], [f"{d.title}\n{d.text}" for d in docs]
    keys = sorted(first.data)
    raise DatasetFormatError(
        p, first.where, f"expected {{id, contents}} or {{docid, text}} records, got {keys}"
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _encoder_digest(folder: Path) -> str:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    listing = [(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def index_settings(kind: str, encoder: str | Path | None) -> dict[str, Any]:
    import bm25s

    settings: dict[str, Any] = {"format": INDEX_FORMAT, "kind": kind}
    if kind == "bm25":
        settings["bm25s"] = bm25s.__version__
    else:
        folder = Path(encoder or "").resolve()
        settings.update(encoder=str(folder), encoder_files=_encoder_digest(folder))
    return settings


def is_current(manifest: dict[str, Any] | None, corpus: Path, settings: dict[str, Any]) -> bool:
    """The reuse rule (module docstring)."""
    if not manifest or manifest.get("settings") != settings:
        return False
    recorded, st = manifest.get("corpus") or {}, corpus.stat()
    if recorded.get("size") != st.st_size:
        return False
    return recorded.get("mtime_ns") == st.st_mtime_ns or recorded.get("sha256") == file_sha256(corpus)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None  # not ours or torn: rebuild
    except OSError as exc:
        raise IndexDirError(directory, exc.strerror or str(exc)) from None
    return data if isinstance(data, dict) else None


def default_index_dir(corpus: str | Path) -> Path:
    p = Path(corpus)
    return p.with_name(p.name + ".index")


def open_index(
    corpus: str | Path,
    kind: str = "bm25",
    index_dir: str | Path | None = None,
    encoder: str | Path | None = None,
) -> OpenedIndex:
    """Loads the saved index when it is current for ``corpus`` (the reuse rule), else builds and saves it."""
    if kind not in INDEX_KINDS:
        raise ValueError(f"unknown index kind {kind!r}; use one of {INDEX_KINDS}")
    if kind == "dense" and encoder is None:
        raise ValueError("a dense index needs an encoder folder")
    path = Path(corpus)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    model = None
    if kind == "dense":
        from actors.envs.dense import load_encoder

        model = load_encoder(encoder or "")
    final = Path(index_dir or default_index_dir(path)) / kind
    settings = index_settings(kind, encoder)
    t0 = time.perf_counter()
    if is_current(read_manifest(final), path, settings):
        return OpenedIndex(_load(kind, final, model), kind, final, True, time.perf_counter() - t0)
    index = _build(path, kind, final, settings, model)
    return OpenedIndex(index, kind, final, False, time.perf_counter() - t0)


def _load(kind: str, directory: Path, encoder: Any) -> Any:
    try:
        if kind == "bm25":
            from actors.envs.search import Bm25Index

            return Bm25Index.load(directory)
        from actors.envs.dense import DenseIndex

        return DenseIndex.load(directory, encoder)
    except PermissionError as exc:
        raise IndexDirError(directory, exc.strerror or "permission denied") from None


def _build(corpus: Path, kind: str, final: Path, settings: dict[str, Any], encoder: Any) -> Any:
    try:  # fail on an unwritable folder now, not after hours of building
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{kind}-", dir=final.parent))
    except OSError as exc:
        raise IndexDirError(final.parent, exc.strerror or str(exc)) from None
    try:
        stat = corpus.stat()  # stamped before reading: a corpus changed meanwhile fails the next check
        stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(corpus)}
        ids, texts = load_service_corpus(corpus)
        index = _new_index(kind, ids, texts, encoder)
        index.save(tmp)
        manifest = {"settings": settings, "corpus": {"path": str(corpus.resolve()), **stamp}, "n": len(ids)}
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _swap_in(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def _new_index(kind: str, ids: list[str], texts: list[str], encoder: Any) -> Any:
    if kind == "bm25":
        from actors.envs.search import Bm25Index

        return Bm25Index(ids, texts)
    from actors.envs.dense import DenseIndex

    return DenseIndex.build(ids, texts, encoder)


def _swap_in(tmp: Path, final: Path) -> None:
    """``tmp`` becomes ``final``; an older ``final`` is moved aside first and removed after."""
    old = None
    if final.exists():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    publish_directory(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
