"""A dense retriever: a local sentence-transformers encoder and an exact inner-product faiss index.

    encoder = load_encoder("/models/all-MiniLM-L6-v2")        # a local folder: never a hub download
    index = DenseIndex.build(ids, texts, encoder)            # passages embedded once, L2-normalized
    index.search(["who founded x?"], topk=3)                 # Search-R1 contract, scores = cosine similarity
    index.save(directory); DenseIndex.load(directory, encoder)

``faiss.IndexFlatIP`` over normalized embeddings is exact cosine search (no training, no recall loss); it
holds n × dim float32 (wiki-18 with a 384-dim encoder: ~32 GB). Queries are embedded as one batch. Ties in
score are broken by corpus position, as in ``Bm25Index``. faiss and sentence-transformers come from the
``retrieval`` extra and are imported on first use.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from storage.durable import write_atomic

PASSAGES_FILE, FAISS_FILE = "passages.jsonl", "index.faiss"


class EncoderError(ValueError):
    """The encoder folder is missing or is not a sentence-transformers model."""


def unhide_sklearn() -> None:
    """sentence-transformers needs scikit-learn, which our processes hide from transformers
    (runtime/lean_imports.py): the hiding `None` entry goes, so the next import finds the package."""
    if "sklearn" in sys.modules and sys.modules["sklearn"] is None:
        del sys.modules["sklearn"]


def load_encoder(path: str | Path, device: str | None = None) -> Any:
    """A SentenceTransformer from a local folder (``modules.json`` or ``config.json`` inside), offline."""
    folder = Path(path)
    if not folder.is_dir():
        raise EncoderError(f"encoder folder {folder} does not exist")
    if not ((folder / "modules.json").is_file() or (folder / "config.json").is_file()):
        raise EncoderError(f"{folder} is not a sentence-transformers folder (no modules.json or config.json)")
    unhide_sklearn()
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device=device, local_files_only=True)


def write_passages(path: Path, ids: Sequence[str], texts: Sequence[str]) -> None:
    rows = (json.dumps({"id": i, "contents": t}, ensure_ascii=False) for i, t in zip(ids, texts, strict=True))
    write_atomic(path, "".join(r + "\n" for r in rows).encode())


def read_passages(path: Path) -> tuple[list[str], list[str]]:
    ids, texts = [], []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            ids.append(row["id"])
            texts.append(row["contents"])
    return ids, texts


class DenseIndex:
    """Exact cosine search over encoded passages; thread-safe (the encoder's tokenizer is not)."""

    def __init__(self, ids: Sequence[str], texts: Sequence[str], encoder: Any, faiss_index: Any) -> None:
        if len(ids) != len(texts) or len(ids) != faiss_index.ntotal:
            raise ValueError(f"{len(ids)} ids, {len(texts)} texts, {faiss_index.ntotal} vectors")
        if not ids:
            raise ValueError("cannot index an empty corpus")
        self.ids, self.texts = list(ids), list(texts)
        self.encoder, self._faiss = encoder, faiss_index
        self._lock = threading.Lock()

    @classmethod
    def build(
        cls, ids: Sequence[str], texts: Sequence[str], encoder: Any, batch_size: int = 64
    ) -> DenseIndex:
        import faiss

        vectors = _encode(encoder, list(texts), batch_size)
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
        return cls(ids, texts, encoder, index)

    def __len__(self) -> int:
        return len(self.ids)

    def search(self, queries: Sequence[str], topk: int) -> list[list[dict[str, Any]]]:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if not queries:
            return []
        k = min(topk, len(self.ids))
        with self._lock:
            vectors = _encode(self.encoder, list(queries), 64)
            scores, rows = self._faiss.search(vectors, k)
        return [self._hits(s, r) for s, r in zip(scores, rows, strict=True)]

    def search_one(self, query: str, topk: int) -> list[dict[str, Any]]:
        return self.search([query], topk)[0]

    def _hits(self, scores: np.ndarray, rows: np.ndarray) -> list[dict[str, Any]]:
        pairs = sorted((-float(s), int(r)) for s, r in zip(scores, rows, strict=True) if r >= 0)
        return [{"id": self.ids[r], "contents": self.texts[r], "score": -s} for s, r in pairs]

    def save(self, directory: str | Path) -> None:
        import faiss

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        write_atomic(path / FAISS_FILE, faiss.serialize_index(self._faiss).tobytes())
        write_passages(path / PASSAGES_FILE, self.ids, self.texts)

    @classmethod
    def load(cls, directory: str | Path, encoder: Any) -> DenseIndex:
        import faiss

        path = Path(directory)
        index = faiss.read_index(str(path / FAISS_FILE))
        ids, texts = read_passages(path / PASSAGES_FILE)
        return cls(ids, texts, encoder, index)


def _encode(encoder: Any, texts: list[str], batch_size: int) -> np.ndarray:
    vectors = encoder.encode(
        texts,
        batch_size=batch_size,
        normalize_embeddings=True,
        convert_to_numpy=True,
        show_progress_bar=False,
    )
    return np.ascontiguousarray(vectors, dtype=np.float32)
