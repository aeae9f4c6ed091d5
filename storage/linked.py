"""Side trees ride with their episode tree: a rollout batch is counted in main trees.

An external agent's side calls (a summariser, a judge, a compaction) are stored as trees of their own, linked
to their episode's tree by meta `episode_tree` (actors/external/side.py). They must not take the learner's
batch slots: `take_batch(n)` hands out the n oldest credited *main* trees, each followed by its side trees,
so a batch of B trees is still B episodes' trees however many side calls the agent made, and a side tree is
trained in the same batch (the same step, the same weights) as its episode tree. A main tree whose side
trees are not all credited yet holds the batch until they are (the backup credits them in commit order, and
they were committed with it), so the order stays the credit order and a rewind hands out the same batches.
A side tree whose episode tree is not in the store is never handed out (the store's stats:
`side_trees.orphans`). Admission (store.eta) counts main trees only, for the same reason
(docs/external-agents.md, "Side calls").

    links = Links()
    links.add(tree_id, episode)                 # per committed tree; episode: its `episode_tree` or None
    ids = links.select(pending, n, uncredited)  # the batch's ids, or None
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import pyarrow as pa

from storage.tree_codec import FlatColumns


def episode_links(batch: pa.RecordBatch, f: FlatColumns) -> list[str | None]:
    """Per tree of the batch: the episode tree it is a side tree of (meta `episode_tree`), else None."""
    roots = pa.array(f.tree_starts[:-1], pa.int64())
    out: list[str | None] = []
    for meta in batch.column("meta").take(roots).to_pylist():
        link = None
        if meta and '"episode_tree"' in meta:
            try:
                link = json.loads(meta).get("episode_tree")
            except (ValueError, AttributeError):
                link = None
        out.append(link if isinstance(link, str) and link else None)
    return out


class Links:
    """Which stored trees are side trees, and of which episode tree."""

    def __init__(self) -> None:
        self.episode: dict[str, str] = {}  # side tree -> its episode tree
        self.sides: dict[str, list[str]] = {}  # episode tree -> its side trees, in commit order

    def add(self, tree_id: str, episode: str | None) -> None:
        if episode is not None and tree_id not in self.episode:
            self.episode[tree_id] = episode
            self.sides.setdefault(episode, []).append(tree_id)

    def mains(self, tree_ids: Iterable[str]) -> int:
        """How many of `tree_ids` are main trees (not side trees)."""
        return sum(t not in self.episode for t in tree_ids)

    def stats(self, stored: Mapping[str, object]) -> dict[str, int]:
        """Side trees in the store, and those whose episode tree is not in it (`stored`): never handed out."""
        return {"total": len(self.episode), "orphans": sum(e not in stored for e in self.episode.values())}

    def select(
        self, pending: Mapping[str, object], n: int, uncredited: Mapping[str, object]
    ) -> list[str] | None:
        """The n oldest `pending` main trees (credited, unconsumed; in credit order), each followed by its
        pending side trees; None while fewer than n main trees are ready (a main tree whose side trees are
        still uncredited holds the batch)."""
        out: list[str] = []
        mains = 0
        for tid in pending:
            if mains == n:
                break
            if tid in self.episode:
                continue  # rides with its episode tree
            sides = self.sides.get(tid, [])
            if any(s in uncredited for s in sides):
                return None
            out += [tid, *(s for s in sides if s in pending)]
            mains += 1
        return out if mains == n else None
