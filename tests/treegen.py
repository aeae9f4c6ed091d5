"""Random initialize-expand rollout-tree *structures* for tests (docs/algorithm.md §2.2-§2.3).

A tree is M initial trajectories, each a chain of T ~ U{1..t_max} turns under the prompt, plus N branches per
trajectory. Anchors are drawn on {1..T-1}: without replacement when T-1 >= N, with replacement when
1 <= T-1 < N (so an anchor can get 3+ children), none when T = 1. The branch from anchor k is a chain of
T' - k turns, T' ~ U{k+1..t_max}, hanging under the node of turn k. Every chain end is a leaf.

Public API (also used by tests/unit/test_losses.py):

    GenTree                 parents (n,) int64 (-1 = child of the prompt), leaf (n,) bool,
                            turn_lengths (n,) int64 (model tokens per turn, ell_i; some are 0),
                            turn_logprob_sums (n,) float64 (sum of behavior log-probs, <= 0; 0 if ell = 0)
    random_tree(rng, m, n)  one tree from a numpy Generator
    tree_strategy(m, n)     the same as a hypothesis strategy (m, n: an int or an inclusive (lo, hi) range)
    random_rewards(rng, leaf, kind)  rewards on leaves, NaN elsewhere; kind in REWARD_KINDS

By default nodes are numbered in creation order (every parent before its children); ``shuffle=True``
relabels them randomly to exercise code that must not assume parent < child.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

REWARD_KINDS = ("binary", "uniform", "one_success")

Ints = Callable[[int, int], int]  # inclusive integer draw
Unit = Callable[[], float]  # draw in [0, 1)


@dataclass(frozen=True, eq=False)
class GenTree:
    parents: np.ndarray
    leaf: np.ndarray
    turn_lengths: np.ndarray
    turn_logprob_sums: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.parents.size)

    @property
    def num_leaves(self) -> int:
        return int(self.leaf.sum())


def _anchors(t: int, n: int, ints: Ints) -> list[int]:
    """N anchors on {1..T-1}: without replacement if possible, with replacement if 1 <= T-1 < N."""
    pool = list(range(1, t))
    if len(pool) >= n:
        for j in range(n):  # partial Fisher-Yates
            k = ints(j, len(pool) - 1)
            pool[j], pool[k] = pool[k], pool[j]
        return pool[:n]
    if pool:
        return [ints(1, t - 1) for _ in range(n)]
    return []


def _build(m: int, n: int, t_max: int, ints: Ints) -> list[int]:
    """Parent array in creation order."""
    parents: list[int] = []

    def chain(parent: int, length: int) -> list[int]:
        ids = []
        for _ in range(length):
            parents.append(parent)
            parent = len(parents) - 1
            ids.append(parent)
        return ids

    for _ in range(m):
        t = ints(1, t_max)
        main = chain(-1, t)
        for k in _anchors(t, n, ints):
            chain(main[k - 1], ints(k + 1, t_max) - k)
    return parents


def _assemble(
    parents: list[int], ints: Ints, unit: Unit, max_len: int, zero_len_prob: float, shuffle: bool
) -> GenTree:
    size = len(parents)
    lengths = [0 if unit() < zero_len_prob else ints(1, max_len) for _ in range(size)]
    # Mean per-token log-prob in (-2, 0]: enough spread for the likelihood weights to matter.
    lps = [-2.0 * unit() * ell for ell in lengths]
    p = np.asarray(parents, dtype=np.int64)
    if shuffle and size > 1:
        perm = list(range(size))
        for j in range(size - 1):
            k = ints(j, size - 1)
            perm[j], perm[k] = perm[k], perm[j]
        new_id = np.asarray(perm, dtype=np.int64)  # old node j becomes new node perm[j]
        q = np.empty(size, dtype=np.int64)
        q[new_id] = np.where(p < 0, -1, new_id[np.maximum(p, 0)])
        p = q
        lengths = _permute(lengths, new_id)
        lps = _permute(lps, new_id)
    leaf = np.ones(size, dtype=bool)
    leaf[p[p >= 0]] = False
    return GenTree(
        parents=p,
        leaf=leaf,
        turn_lengths=np.asarray(lengths, dtype=np.int64),
        turn_logprob_sums=np.asarray(lps, dtype=np.float64),
    )


def _permute(values: list, new_id: np.ndarray) -> list:
    out = list(values)
    for old, new in enumerate(new_id):
        out[int(new)] = values[old]
    return out


def random_tree(
    rng: np.random.Generator,
    m: int,
    n: int,
    t_max: int = 8,
    *,
    max_len: int = 32,
    zero_len_prob: float = 0.1,
    shuffle: bool = False,
) -> GenTree:
    """One initialize-expand tree with M trajectories and N branches each (see module docstring)."""

    def ints(lo: int, hi: int) -> int:
        return int(rng.integers(lo, hi + 1))

    def unit() -> float:
        return float(rng.random())

    return _assemble(_build(m, n, t_max, ints), ints, unit, max_len, zero_len_prob, shuffle)


def _range(x: int | tuple[int, int]) -> st.SearchStrategy[int]:
    lo, hi = (x, x) if isinstance(x, int) else x
    return st.integers(lo, hi)


def tree_strategy(
    m: int | tuple[int, int] = (1, 4),
    n: int | tuple[int, int] = (0, 3),
    t_max: int = 6,
    *,
    max_len: int = 16,
    zero_len_prob: float = 0.1,
    shuffle: bool = True,
) -> st.SearchStrategy[GenTree]:
    """Hypothesis strategy of GenTree; shrinks toward small M, N, T and creation order."""

    @st.composite
    def strat(draw: st.DrawFn) -> GenTree:
        def ints(lo: int, hi: int) -> int:
            return draw(st.integers(lo, hi))

        def unit() -> float:
            return draw(st.floats(0.0, 1.0, exclude_max=True))

        parents = _build(draw(_range(m)), draw(_range(n)), t_max, ints)
        return _assemble(parents, ints, unit, max_len, zero_len_prob, shuffle and draw(st.booleans()))

    return strat()


def random_rewards(rng: np.random.Generator, leaf: np.ndarray, kind: str) -> np.ndarray:
    """Rewards on the leaves (NaN on internal nodes): binary {0,1}, uniform [0,1) or exactly one success."""
    k = int(leaf.sum())
    if kind == "binary":
        r = rng.integers(0, 2, size=k).astype(np.float64)
    elif kind == "uniform":
        r = rng.random(k)
    elif kind == "one_success":
        r = np.zeros(k)
        r[rng.integers(k)] = 1.0
    else:
        raise ValueError(f"kind must be one of {REWARD_KINDS}, got {kind!r}")
    out = np.full(leaf.shape, np.nan)
    out[leaf] = r
    return out
