"""One tree being grown by the sampler (actors/tree_sampler.py): its plan (builder, generator, episodes), the
episodes that start it and its branches, and the coroutine that grows it on its own in the async loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from actors.agent_loop import Episode
from actors.async_loop import EpisodeRunner, gather_or_cancel
from actors.envs.base import Task
from system.tree_build import TreeBuilder


@dataclass
class TreePlan:
    """One tree being sampled: its builder, its own generator (anchors, episode seeds), its episodes."""

    task: Task
    builder: TreeBuilder
    rng: np.random.Generator
    trunks: list[Episode]
    branches: list[Episode] = field(default_factory=list)

    @property
    def episodes(self) -> list[Episode]:
        return [*self.trunks, *self.branches]


def first_episode(task: Task, b: TreeBuilder, key: str, rng: np.random.Generator) -> Episode:
    """One of the M initial trajectories: from the prompt, with its own seed from the tree's generator."""
    seed = int(rng.integers(1 << 62))
    ctx = b.context_tokens(0)
    return Episode(task, b, parent=0, context=ctx, calls=[], turns_done=0, key=key, seed=seed)


def branch_episode(p: TreePlan, trunk: Episode, k: int, j: int) -> Episode:
    """A fresh suffix from boundary k of `trunk`: under its k-th turn, after that turn's observation."""
    anchor, b = trunk.nodes[k - 1], p.builder
    return Episode(
        p.task,
        b,
        parent=anchor,
        context=b.context_tokens(anchor),
        calls=list(trunk.calls[:k]),
        turns_done=k,
        key=f"{b.tree_id}/b{j}",
        seed=int(p.rng.integers(1 << 62)),
        parent_key=trunk.key,  # the backend crops the trunk's cache to the shared prefix
    )


_Expand = Callable[[TreePlan], list[Episode]]


async def grow_all(runner: EpisodeRunner, plans: list[TreePlan], expand: _Expand) -> None:
    await runner.drive(gather_or_cancel(*(_grow(runner, p, expand) for p in plans)))


async def _grow(runner: EpisodeRunner, p: TreePlan, expand: _Expand) -> None:
    """One tree on its own: its trajectories, then (at once) its branches, then its caches freed. A failing
    episode cancels the others (`gather_or_cancel`): the round fails as a whole, with nothing left running."""
    await gather_or_cancel(*(runner.run(e) for e in p.trunks))
    p.branches = expand(p)
    await gather_or_cancel(*(runner.run(e) for e in p.branches))
    await runner.server.release(*(e.key for e in p.episodes))
