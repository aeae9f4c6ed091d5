"""Retrieval recall of evaluation episodes against qrels: of a task's gold documents, the fraction that any
search of the episode returned.

    gold = gold_ids(task)                       # from `treeopsd eval --qrels FILE`, or BrowseComp-Plus's own
    recalls = episode_recall(env, episodes)     # one float per episode (None: the task has no gold docs)

Gold documents: the TREC qrels of `--qrels` (relevance > 0; `attach_qrels` puts them in the task's meta
as `qrels_docids`), else a BrowseComp-Plus query's `evidence_docs`, else its `gold_docs`. The searches are
replayed (the tools are pure: the same query gives the same hits), all queries of a batch in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

GOLD_KEYS = ("qrels_docids", "evidence_docids", "gold_docids")


def attach_qrels(tasks: Sequence[Any], qrels: dict[str, dict[str, int]]) -> list[Any]:
    """Tasks with their relevant qrels documents in `meta["qrels_docids"]` (tasks without qrels unchanged)."""
    out = []
    for t in tasks:
        rel = qrels.get(t.task_id)
        if rel is None:
            out.append(t)
            continue
        out.append(replace(t, meta={**t.meta, "qrels_docids": sorted(d for d, r in rel.items() if r > 0)}))
    return out


def gold_ids(task: Any) -> set[str]:
    for key in GOLD_KEYS:
        ids = task.meta.get(key)
        if ids:
            return {str(i) for i in ids}
    return set()


def _queries(episode: Any) -> list[str]:
    calls = [c for c in episode.calls if c is not None and c.name == "search"]
    return [str(q).strip() for c in calls if isinstance(q := c.arguments.get("query"), str) and q.strip()]


def episode_recall(env: Any, episodes: Sequence[Any]) -> list[float | None]:
    """Recall per episode (module docstring); None where the task has no gold documents or the env has
    no index to replay the searches on."""
    index, topk = getattr(env, "index", None), getattr(env, "topk", None)
    golds = [gold_ids(e.task) for e in episodes]
    if index is None or topk is None or not any(golds):
        return [None] * len(episodes)
    queries = [_queries(e) if g else [] for e, g in zip(episodes, golds, strict=True)]
    flat = sorted({q for qs in queries for q in qs})
    try:
        hits = dict(zip(flat, index.search(flat, topk), strict=True)) if flat else {}
    except Exception:  # e.g. the retrieval service went away: no recall rather than no evaluation
        return [None] * len(episodes)
    out: list[float | None] = []
    for gold, qs in zip(golds, queries, strict=True):
        found = {str(h["id"]) for q in qs for h in hits[q]}
        out.append(len(gold & found) / len(gold) if gold else None)
    return out
