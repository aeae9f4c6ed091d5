"""Initialize–expand bookkeeping (docs/algorithm.md §2): anchor choice and node-id assignment by construction.

The sampler runs the environment; this module only decides where branches go and hands out node ids, so
that every turn appears once and the merged tree needs no string matching.

Anchors of a trajectory with T turns are the non-terminal boundaries 𝒜 = {1, …, T−1}; boundary k is the
state after turn a_k and its observation o_k, so a branch from k hangs under a_k's node and may take at most
`max_turns − k` turns.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import numpy as np

from system.tree import RESTARTS, ROOT, RolloutTree, TurnNode, make_node


def choose_anchors(num_turns: int, n: int, rng: np.random.Generator) -> list[int]:
    """N anchors on {1..T−1}: without replacement if |𝒜| ≥ N, with replacement if 1 ≤ |𝒜| < N, none at T=1."""
    k = num_turns - 1
    if n <= 0 or k < 1:
        return []
    picks = rng.choice(np.arange(1, num_turns), size=n, replace=k < n)
    return sorted(int(a) for a in picks)


def plan_anchors(
    turn_counts: Sequence[int], n: int, rng: np.random.Generator, shortfall: str = "skip"
) -> list[tuple[int, int]]:
    """(trajectory, anchor) pairs for a prompt's M trajectories.

    shortfall="skip": a trajectory with T = 1 gets no branches (K shrinks).
    shortfall="reallocate": its N branches go to trajectories that have anchors, round-robin.
    """
    if shortfall not in ("skip", "reallocate"):
        raise ValueError(f"anchor_shortfall must be 'skip' or 'reallocate', got {shortfall!r}")
    plan = [(m, a) for m, t in enumerate(turn_counts) for a in choose_anchors(t, n, rng)]
    if shortfall == "reallocate":
        donors = [m for m, t in enumerate(turn_counts) if t >= 2]
        missing = n * sum(1 for t in turn_counts if t < 2)
        for j in range(missing if donors else 0):
            m = donors[j % len(donors)]
            plan.append((m, int(rng.integers(1, turn_counts[m]))))
    return sorted(plan)


class TreeBuilder:
    """Hands out node ids as turns are appended; `build()` validates and freezes the tree."""

    def __init__(
        self,
        tree_id: str,
        prompt_tokens: Sequence[int],
        prompt_id: str = "",
        meta: dict[str, str] | None = None,
    ) -> None:
        self.tree_id, self.prompt_id, self.meta = tree_id, prompt_id, dict(meta or {})
        self._nodes: list[TurnNode] = [make_node(ROOT, -1, 0, obs_tokens=prompt_tokens)]
        self._restart_nodes: list[int] = []

    def add_turn(
        self,
        parent: int,
        tokens: Sequence[int],
        logprobs: Sequence[float],
        obs_tokens: Sequence[int] = (),
        loss_mask: Sequence[bool] | None = None,
        policy_version: int = 0,
    ) -> int:
        node_id = len(self._nodes)
        depth = self._nodes[parent].depth + 1
        self._nodes.append(
            make_node(node_id, parent, depth, tokens, loss_mask, logprobs, obs_tokens, policy_version)
        )
        return node_id

    def add_restart(self, parent: int, context: Sequence[int], policy_version: int = 0) -> int:
        """A restart under `parent` (system/tree.py): the turns added under it see `context` (e.g. a compacted
        conversation's prompt ids) and not the path above it."""
        node_id = self.add_turn(parent, [], [], obs_tokens=context, policy_version=policy_version)
        self._restart_nodes.append(node_id)
        return node_id

    def children(self, node_id: int) -> list[int]:
        return [n.node_id for n in self._nodes if n.parent == node_id]

    def is_restart(self, node_id: int) -> bool:
        return node_id in self._restart_nodes

    def set_observation(self, node_id: int, obs_tokens: Sequence[int]) -> None:
        n = self._nodes[node_id]
        self._nodes[node_id] = make_node(
            n.node_id,
            n.parent,
            n.depth,
            n.tokens,
            n.loss_mask,
            n.behavior_logprobs,
            obs_tokens,
            n.policy_version,
        )

    def set_reward(self, node_id: int, reward: float) -> None:
        n = self._nodes[node_id]
        self._nodes[node_id] = make_node(
            n.node_id,
            n.parent,
            n.depth,
            n.tokens,
            n.loss_mask,
            n.behavior_logprobs,
            n.obs_tokens,
            n.policy_version,
            reward,
        )

    def remove(self, node_ids: Iterable[int]) -> dict[int, int]:
        """Removes these turns and every turn under them (a dropped branch) and renumbers the rest in order;
        returns old id -> new id of the kept nodes. Only between samplings: ids held elsewhere go stale."""
        gone = set(node_ids)
        if ROOT in gone:
            raise ValueError(f"tree {self.tree_id!r}: the root cannot be removed")
        for n in self._nodes[1:]:  # a child's id is above its parent's: one pass finds every descendant
            if n.parent in gone:
                gone.add(n.node_id)
        kept = [n for n in self._nodes if n.node_id not in gone]
        remap = {n.node_id: i for i, n in enumerate(kept)}
        self._nodes = [
            make_node(
                remap[n.node_id],
                remap.get(n.parent, -1),
                n.depth,
                n.tokens,
                n.loss_mask,
                n.behavior_logprobs,
                n.obs_tokens,
                n.policy_version,
                None if np.isnan(n.reward) else float(n.reward),
            )
            for n in kept
        ]
        return remap

    def node(self, node_id: int) -> TurnNode:
        return self._nodes[node_id]

    def context_tokens(self, node_id: int) -> list[int]:
        """Prompt + every turn and observation on the path to `node_id` (inclusive): a branch's prefix. From
        the nearest restart on that path, if any (its context, then what follows)."""
        path = []
        while node_id != -1:
            path.append(self._nodes[node_id])
            if node_id in self._restart_nodes:
                break
            node_id = self._nodes[node_id].parent
        out: list[int] = []
        for n in reversed(path):
            out.extend(n.tokens.tolist())
            out.extend(n.obs_tokens.tolist())
        return out

    def build(self) -> RolloutTree:
        if self._restart_nodes:
            self.meta[RESTARTS] = json.dumps(sorted(self._restart_nodes))
        return RolloutTree.build(self.tree_id, self._nodes, self.prompt_id, self.meta)
