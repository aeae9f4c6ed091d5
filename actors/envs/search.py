"""BM25 retrieval (bm25s) behind the Search-R1 retriever contract.

``search(queries, topk) -> [[{"id", "contents", "score"}, ...] per query]``, best first. Ties are broken by
corpus order so results are reproducible (bm25s' own top-k selection is not stable under ties). A query with
no indexed term (empty, only stop words, unknown words) returns ``[]``; documents scoring 0 (no shared
term) are never returned, so a result list can be shorter than ``topk``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from storage.durable import write_atomic

_PASSAGES_FILE = "passages.jsonl"


@dataclass(frozen=True)
class Passage:
    """A retrievable unit. ``contents`` follows wiki-18: the quoted title on the first line."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.text}' if self.title else self.text


class Retriever(Protocol):
    """Anything with the Search-R1 contract (a local index, or a client of a /retrieve server)."""

    def search(self, queries: Sequence[str], topk: int) -> list[list[dict[str, Any]]]: ...


STOPWORDS = "en"


def _tokenize(texts: list[str], *, return_ids: bool) -> Any:
    import bm25s  # on first use: a client of the retrieval service never loads bm25s (numba, scipy)

    return bm25s.tokenize(texts, stopwords=STOPWORDS, return_ids=return_ids, show_progress=False)


def _query_tokenizer(vocab: dict[str, int]) -> Any:
    """bm25s' `Tokenizer` on the index's own vocabulary: a query's ids straight away, words the index has
    not seen dropped. The same split, lower-casing and stop words as `_tokenize` (bm25s' defaults), at an
    eighth of its cost per query (`bm25s.tokenize` builds a vocabulary and progress bars on every call)."""
    from bm25s.tokenization import Tokenizer

    tokenizer = Tokenizer(stopwords=STOPWORDS)
    tokenizer.word_to_id = dict(vocab)  # read-only from here: queries never add words
    return tokenizer


QUERY_CACHE = 8192  # distinct (query, topk) kept per index (hits share the index's texts: ~1 KB each)


class Bm25Index:
    """An in-memory BM25 index over ``(ids, texts)``; ``texts`` are what the search tool returns."""

    def __init__(self, ids: Sequence[str], texts: Sequence[str], *, _retriever: Any = None) -> None:
        if len(ids) != len(texts):
            raise ValueError(f"{len(ids)} ids but {len(texts)} texts")
        if not ids:
            raise ValueError("cannot index an empty corpus")
        self.ids: list[str] = list(ids)
        self.texts: list[str] = list(texts)
        self._pos: dict[str, int] = {}
        for i, doc_id in enumerate(self.ids):
            if doc_id in self._pos:
                raise ValueError(f"duplicate passage id {doc_id!r} at positions {self._pos[doc_id]} and {i}")
            self._pos[doc_id] = i
        if _retriever is None:
            import bm25s

            _retriever = bm25s.BM25()
            _retriever.index(_tokenize(self.texts, return_ids=True), show_progress=False)
        self._bm25 = _retriever
        self._queries = _query_tokenizer(_retriever.vocab_dict)
        # The search tool of a tree's episodes repeats the same queries (every trajectory looks up the
        # same first hop); the index is immutable, so a query's hits are computed once. A lock: the
        # sampler's tool threads and the retrieval service's handlers share one index.
        self._hits: OrderedDict[tuple[str, int], tuple[dict[str, Any], ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_hits = self.cache_misses = 0

    @classmethod
    def from_passages(cls, passages: Sequence[Passage]) -> Bm25Index:
        return cls([p.id for p in passages], [p.contents for p in passages])

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._pos

    def text(self, doc_id: str) -> str:
        """The indexed text of a passage; KeyError for an unknown id."""
        return self.texts[self._pos[doc_id]]

    def search(self, queries: Sequence[str], topk: int) -> list[list[dict[str, Any]]]:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        found = self._cached(queries, topk)
        misses = list(dict.fromkeys(q for q in queries if q not in found))
        if misses:
            tokenized = self._queries.streaming_tokenize(misses, update_vocab=False, allow_empty=False)
            fresh = {q: tuple(self._search_ids(t, topk)) for q, t in zip(misses, tokenized, strict=True)}
            self._remember(fresh, topk)
            found.update(fresh)
        return [[dict(hit) for hit in found[q]] for q in queries]  # copies: callers own them

    def search_one(self, query: str, topk: int) -> list[dict[str, Any]]:
        return self.search([query], topk)[0]

    def clear_cache(self) -> None:
        with self._lock:
            self._hits.clear()

    def _cached(self, queries: Sequence[str], topk: int) -> dict[str, tuple[dict[str, Any], ...]]:
        found = {}
        with self._lock:
            for q in queries:
                hits = self._hits.get((q, topk))
                if hits is not None:
                    self._hits.move_to_end((q, topk))
                    found[q] = hits
            served = sum(q in found for q in queries)  # per query asked: a repeat counts again
            self.cache_hits += served
            self.cache_misses += len(queries) - served
        return found

    def _remember(self, fresh: dict[str, tuple[dict[str, Any], ...]], topk: int) -> None:
        with self._lock:
            for q, hits in fresh.items():
                self._hits[(q, topk)] = hits
            while len(self._hits) > QUERY_CACHE:
                self._hits.popitem(last=False)

    def _search_ids(self, token_ids: list[int], topk: int) -> list[dict[str, Any]]:
        if not token_ids:
            return []
        scores = np.asarray(self._bm25.get_scores_from_ids(token_ids), dtype=np.float64)
        cand = np.flatnonzero(scores > 0)  # a score of 0 is never returned; most documents have one
        k = min(topk, len(cand))
        if k < len(cand):
            # Keep everything tied with the k-th best, then sort by (-score, position): stable under ties.
            kth = np.partition(scores[cand], len(cand) - k)[len(cand) - k]
            cand = cand[scores[cand] >= kth]
        order = cand[np.lexsort((cand, -scores[cand]))][:k]
        return [{"id": self.ids[i], "contents": self.texts[i], "score": float(scores[i])} for i in order]

    def save(self, directory: str | Path) -> None:
        """Write the bm25s arrays plus our own ``passages.jsonl`` (ids and texts, in index order)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._bm25.save(str(path), show_progress=False)
        rows = (
            json.dumps({"id": i, "contents": t}, ensure_ascii=False)
            for i, t in zip(self.ids, self.texts, strict=True)
        )
        write_atomic(
            path / _PASSAGES_FILE, "".join(r + "\n" for r in rows).encode()
        )  # last: marks a whole index

    @classmethod
    def load(cls, directory: str | Path) -> Bm25Index:
        import bm25s

        path = Path(directory)
        ids, texts = [], []
        with open(path / _PASSAGES_FILE, encoding="utf-8") as fh:
            for line in fh:
                row = json.loads(line)
                ids.append(row["id"])
                texts.append(row["contents"])
        retriever = bm25s.BM25.load(str(path), show_progress=False)
        return cls(ids, texts, _retriever=retriever)
