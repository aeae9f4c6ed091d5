"""The rollout-tree data model: one prompt, its turns as nodes, every turn stored once.

Layout (docs/algorithm.md §1, §2.3, §2.4)::

    node 0  root   depth 0  obs_tokens = the prompt's token ids (context only, never in the loss)
    node i  turn   depth d  tokens = what the harness/model put in the assistant message,
                            loss_mask = 1 on tokens the policy sampled, behavior_logprobs per token,
                            obs_tokens = the environment tokens after the turn (masked),
                            policy_version = the weights that sampled it, reward on leaves only.

A *restart* (an external agent's compaction, a summary or sub-agent call: docs/external-agents.md) is a node
without turn tokens whose obs_tokens begin a new context: the turns under it see those tokens and what
follows them, not its ancestors'. Restarts are listed in the meta (`RESTARTS`, a JSON list of node ids), so a
tree without one is stored, packed and trained as before; the credit backup sees an ordinary tree.

Node ids are 0..n-1 (the sampler assigns them by construction, parents before children, but the validator
accepts any acyclic order). A leaf is a turn without children; K = number of leaves. The owner sequence of a
turn (the single packed sequence that trains it) is the leaf reached by always following the first-created
(lowest id) child, so the original trajectory owns its turns and a branch owns only its fresh suffix.

Non-finite behavior log-probs on loss tokens are not an error (docs/algorithm.md §10): such tokens are dropped
from s_i and ℓ_i (`effective_mask`) and counted (`nonfinite_tokens`); the learner fails loudly when too many
turns of a step are affected (`check_nonfinite_fraction`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

ROOT = 0
RESTARTS = "restarts"  # meta key: the restart nodes (module docstring), a JSON list of node ids


class TreeValidationError(ValueError):
    """A rollout tree whose structure or contents break the invariants above."""


@dataclass(frozen=True, eq=False)
class TurnNode:
    node_id: int
    parent: int  # -1 only for the root
    depth: int
    tokens: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # bool [L]
    behavior_logprobs: np.ndarray  # float32 [L]; only loss tokens are meaningful
    obs_tokens: np.ndarray  # int32 [O]
    policy_version: int = 0
    reward: float = float("nan")  # finite on leaves, NaN elsewhere

    def equals(self, other: TurnNode) -> bool:
        """Exact equality, NaN-aware (log-probs of masked tokens may be NaN)."""
        return (
            (self.node_id, self.parent, self.depth, self.policy_version)
            == (other.node_id, other.parent, other.depth, other.policy_version)
            and _same_float(self.reward, other.reward)
            and np.array_equal(self.tokens, other.tokens)
            and np.array_equal(self.loss_mask, other.loss_mask)
            and np.array_equal(self.behavior_logprobs, other.behavior_logprobs, equal_nan=True)
            and np.array_equal(self.obs_tokens, other.obs_tokens)
        )


def make_node(
    node_id: int,
    parent: int,
    depth: int,
    tokens: Sequence[int] | np.ndarray = (),
    loss_mask: Sequence[bool] | np.ndarray | None = None,
    behavior_logprobs: Sequence[float] | np.ndarray | None = None,
    obs_tokens: Sequence[int] | np.ndarray = (),
    policy_version: int = 0,
    reward: float | None = None,
) -> TurnNode:
    """Builds a node from plain sequences; loss_mask defaults to all ones, log-probs to NaN."""
    toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
    mask = np.ones(len(toks), bool) if loss_mask is None else np.asarray(loss_mask, dtype=bool).reshape(-1)
    if behavior_logprobs is None:
        lp = np.full(len(toks), np.nan, np.float32)
    else:
        lp = np.asarray(behavior_logprobs, dtype=np.float32).reshape(-1)
    obs = np.asarray(obs_tokens, dtype=np.int32).reshape(-1)
    r = float("nan") if reward is None else float(reward)
    return TurnNode(int(node_id), int(parent), int(depth), toks, mask, lp, obs, int(policy_version), r)


@dataclass(frozen=True, eq=False)
class NodeCredit:
    """What the backup actor adds (docs/algorithm.md §3–§4), one entry per node, root included (NaN there).

    z is finite on leaves only; tau is None when the tree has K < 2 leaves (then V ≡ 0, q ≡ 1/2).
    """

    z: np.ndarray  # float64 [n]
    V: np.ndarray  # float64 [n]
    q: np.ndarray  # float64 [n]
    tau: float | None

    def equals(self, other: NodeCredit | None) -> bool:
        return (
            other is not None
            and _same_float(
                float("nan") if self.tau is None else self.tau,
                float("nan") if other.tau is None else other.tau,
            )
            and all(
                np.array_equal(a, b, equal_nan=True)
                for a, b in ((self.z, other.z), (self.V, other.V), (self.q, other.q))
            )
        )


@dataclass(frozen=True, eq=False)
class RolloutTree:
    """A validated rollout tree. Build with `RolloutTree.build` (validates) — never mutate arrays in place."""

    tree_id: str
    nodes: tuple[TurnNode, ...]
    prompt_id: str = ""
    meta: dict[str, str] = field(default_factory=dict)
    credit: NodeCredit | None = None

    def with_credit(self, credit: NodeCredit) -> RolloutTree:
        n = len(self.nodes)
        if not (len(credit.z) == len(credit.V) == len(credit.q) == n):
            raise TreeValidationError(
                f"tree {self.tree_id!r}: credit arrays must have one entry per node ({n})"
            )
        return replace(self, credit=credit)

    @classmethod
    def build(
        cls,
        tree_id: str,
        nodes: Iterable[TurnNode],
        prompt_id: str = "",
        meta: dict[str, str] | None = None,
        credit: NodeCredit | None = None,
    ) -> RolloutTree:
        tree = cls(
            str(tree_id), tuple(sorted(nodes, key=lambda n: n.node_id)), str(prompt_id), dict(meta or {})
        )
        validate_tree(tree)
        return tree if credit is None else tree.with_credit(credit)

    # ---- structure (derived, cached) -------------------------------------------------------------
    @cached_property
    def parents(self) -> np.ndarray:
        return np.array([n.parent for n in self.nodes], dtype=np.int64)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in self.nodes]
        for n in self.nodes[1:]:
            kids[n.parent].append(n.node_id)
        return tuple(tuple(sorted(k)) for k in kids)

    @cached_property
    def leaves(self) -> np.ndarray:
        """Ids of terminal turns (turns without children), ascending."""
        return np.array([n.node_id for n in self.nodes[1:] if not self.children[n.node_id]], dtype=np.int64)

    @property
    def num_leaves(self) -> int:
        return len(self.leaves)

    @property
    def prompt_tokens(self) -> np.ndarray:
        return self.nodes[ROOT].obs_tokens

    @cached_property
    def owner_leaf(self) -> np.ndarray:
        """owner_leaf[i]: the leaf whose sequence trains turn i (first-created child, repeatedly)."""
        owner = np.full(len(self.nodes), -1, np.int64)
        for i in reversed(self.topological_order):
            kids = self.children[i]
            owner[i] = i if not kids else owner[kids[0]]
        return owner

    @cached_property
    def topological_order(self) -> np.ndarray:
        """Node ids with every parent before its children (pre-order, children by id)."""
        order, stack = [], [ROOT]
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(reversed(self.children[i]))
        return np.array(order, dtype=np.int64)

    def path(self, node_id: int) -> list[int]:
        """Turn ids from the first turn down to `node_id` (root excluded)."""
        out = []
        while node_id != ROOT:
            out.append(node_id)
            node_id = self.nodes[node_id].parent
        return out[::-1]

    @cached_property
    def restarts(self) -> frozenset[int]:
        """The restart nodes (module docstring); empty for a tree without any."""
        raw = self.meta.get(RESTARTS)
        return frozenset(int(i) for i in json.loads(raw)) if raw else frozenset()

    def context_runs(self, node_id: int) -> list[list[int]]:
        """[ROOT, *path(node_id)] cut before each restart: the nodes of each context the path runs through,
        each run starting at the root or a restart node (one run for a tree without restarts)."""
        runs = [[ROOT]]
        for i in self.path(node_id):
            if i in self.restarts:
                runs.append([])
            runs[-1].append(i)
        return runs

    def turn_parents(self) -> np.ndarray:
        """Parent array over turns only (index = node_id − 1; −1 = child of the prompt) for system.credit."""
        return np.array([n.parent - 1 for n in self.nodes[1:]], dtype=np.int64)

    def leaf_rewards(self) -> np.ndarray:
        return np.array([self.nodes[i].reward for i in self.leaves], dtype=np.float64)

    def effective_mask(self, node_id: int) -> np.ndarray:
        """Loss mask with non-finite behavior log-probs dropped (docs/algorithm.md §10)."""
        n = self.nodes[node_id]
        mask: np.ndarray = n.loss_mask & np.isfinite(n.behavior_logprobs)
        return mask

    @cached_property
    def nonfinite_tokens(self) -> int:
        return int(sum((n.loss_mask & ~np.isfinite(n.behavior_logprobs)).sum() for n in self.nodes))

    @cached_property
    def versions(self) -> np.ndarray:
        return np.array([n.policy_version for n in self.nodes[1:]], dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        """Unique stored tokens (prompt, turns, observations): what a tree-packed forward processes."""
        return int(sum(len(n.tokens) + len(n.obs_tokens) for n in self.nodes))

    def equals(self, other: RolloutTree) -> bool:
        same_credit = (self.credit is None and other.credit is None) or (
            self.credit is not None and self.credit.equals(other.credit)
        )
        return (
            (self.tree_id, self.prompt_id, self.meta) == (other.tree_id, other.prompt_id, other.meta)
            and same_credit
            and len(self.nodes) == len(other.nodes)
            and all(a.equals(b) for a, b in zip(self.nodes, other.nodes, strict=True))
        )


def validate_tree(tree: RolloutTree) -> None:
    """Raises TreeValidationError naming the tree, the node and the broken rule."""
    where = f"tree {tree.tree_id!r}"
    nodes = tree.nodes
    if not nodes:
        raise TreeValidationError(f"{where}: no nodes")
    ids = [n.node_id for n in nodes]
    if ids != list(range(len(nodes))):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise TreeValidationError(
            f"{where}: node ids must be 0..{len(nodes) - 1} without gaps; duplicates {dup}"
        )
    roots = [n.node_id for n in nodes if n.parent == -1]
    if roots != [ROOT]:
        raise TreeValidationError(f"{where}: exactly one root (node 0, parent -1) is required, found {roots}")
    if len(nodes) < 2:
        raise TreeValidationError(f"{where}: the tree has no turns")
    for n in nodes[1:]:
        if not 0 <= n.parent < len(nodes):
            raise TreeValidationError(f"{where}: node {n.node_id} has dangling parent {n.parent}")
    _check_acyclic(tree, where)
    root = nodes[ROOT]
    if len(root.tokens) or root.depth != 0 or not np.isnan(root.reward):
        raise TreeValidationError(f"{where}: the root must have depth 0, no turn tokens and no reward")
    for n in nodes[1:]:
        _validate_turn(n, nodes[n.parent].depth, bool(tree.children[n.node_id]), where)
    _check_restarts(tree, where)


def _check_restarts(tree: RolloutTree, where: str) -> None:
    """Restart nodes are turns without tokens that open a context (obs_tokens) for the turns under them."""
    try:
        listed = tree.restarts
    except (ValueError, TypeError) as exc:
        why = f"meta {RESTARTS!r} is not a JSON list of node ids ({exc})"
        raise TreeValidationError(f"{where}: {why}") from None
    for i in sorted(listed):
        if not 0 < i < len(tree.nodes):
            raise TreeValidationError(f"{where}: restart {i} is not a turn node")
        n = tree.nodes[i]
        if len(n.tokens) or not len(n.obs_tokens) or not tree.children[i]:
            raise TreeValidationError(
                f"{where} node {i}: a restart has no turn tokens, a context (obs tokens) and a turn under it"
            )


def _check_acyclic(tree: RolloutTree, where: str) -> None:
    state = np.zeros(len(tree.nodes), np.int8)  # 0 unseen, 1 on current walk, 2 reaches the root
    state[ROOT] = 2
    for start in range(len(tree.nodes)):
        walk, i = [], start
        while state[i] == 0:
            state[i] = 1
            walk.append(i)
            i = tree.nodes[i].parent
        if state[i] == 1:
            raise TreeValidationError(
                f"{where}: cycle through node {i} (parent pointers never reach the root)"
            )
        state[walk] = 2


def _validate_turn(n: TurnNode, parent_depth: int, has_children: bool, where: str) -> None:
    at = f"{where} node {n.node_id}"
    if n.depth != parent_depth + 1:
        raise TreeValidationError(f"{at}: depth {n.depth} but its parent has depth {parent_depth}")
    size = len(n.tokens)
    if len(n.loss_mask) != size or len(n.behavior_logprobs) != size:
        raise TreeValidationError(
            f"{at}: tokens ({size}), loss_mask ({len(n.loss_mask)}) and behavior_logprobs "
            f"({len(n.behavior_logprobs)}) must have the same length"
        )
    if n.tokens.dtype != np.int32 or n.obs_tokens.dtype != np.int32 or (size and n.tokens.min() < 0):
        raise TreeValidationError(f"{at}: token ids must be non-negative int32")
    lp = n.behavior_logprobs[n.loss_mask]
    if np.any(lp[np.isfinite(lp)] > 1e-4):
        raise TreeValidationError(f"{at}: behavior log-prob > 0 (not a log-probability)")
    if n.policy_version < 0:
        raise TreeValidationError(f"{at}: policy_version must be >= 0, got {n.policy_version}")
    if has_children and not np.isnan(n.reward):
        raise TreeValidationError(f"{at}: only leaves carry a reward, this internal turn has {n.reward}")
    if not has_children and not np.isfinite(n.reward):
        raise TreeValidationError(f"{at}: leaf without a finite reward ({n.reward})")


def check_nonfinite_fraction(affected_turns: int, total_turns: int, limit: float = 0.01) -> None:
    """Over `limit` of a step's turns with non-finite log-probs means a μ/π bug (docs/algorithm.md §10)."""
    if total_turns and affected_turns / total_turns > limit:
        raise FloatingPointError(
            f"{affected_turns} of {total_turns} turns have non-finite log-probs (> {limit:.0%}); "
            "this indicates a behavior/learner log-prob mismatch"
        )


def _same_float(a: float, b: float) -> bool:
    return (np.isnan(a) and np.isnan(b)) or a == b
