"""Parent arrays: the shape of a rollout tree as the credit math sees it (docs/algorithm.md §2).

``parents[i]`` is the index of turn i's parent turn, or -1 when turn i is a first turn (a child of the prompt,
which is not a node). Nodes may be numbered in any order. Leaves are the nodes without children. Depths come
from pointer doubling, which also finds cycles, so every check is O(n log n) numpy work.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def as_parents(parents: npt.ArrayLike) -> IntArray:
    """Validate shape/range and return int64 parents (no cycle check here)."""
    p = np.asarray(parents)
    if p.ndim != 1:
        raise ValueError(f"parents must be 1-D, got shape {p.shape}")
    if p.dtype.kind == "f" and p.size and not np.all(np.isfinite(p) & (p == np.round(p))):
        bad = int(np.flatnonzero(~(np.isfinite(p) & (p == np.round(p))))[0])
        raise ValueError(f"parents[{bad}] = {float(p[bad])} is not an integer node index")
    if p.dtype.kind not in "iuf" and p.size:
        raise ValueError(f"parents must be integers, got dtype {p.dtype}")
    p = p.astype(np.int64)
    n = p.size
    out_of_range = np.flatnonzero((p < -1) | (p >= n))
    if out_of_range.size:
        i = int(out_of_range[0])
        raise ValueError(f"parent of node {i} is {int(p[i])}, outside [-1, {n - 1}]")
    return p


def depths_checked(p: IntArray) -> IntArray:
    """Depth of every node (first turn = 1) by pointer doubling; ValueError on a cycle."""
    n = p.size
    # Node n is a sentinel standing for the prompt; it points to itself.
    jump = np.where(p < 0, n, p)
    jump = np.append(jump, n)
    dist = np.ones(n + 1, dtype=np.int64)
    dist[n] = 0
    # After k rounds jump[i] is the 2^k-th ancestor; 2^k >= n+1 reaches the prompt unless on a cycle.
    for _ in range(max(1, int(n).bit_length() + 1)):
        if np.all(jump == n):
            break
        dist = dist + dist[jump]
        jump = jump[jump]
    stuck = np.flatnonzero(jump[:n] != n)
    if stuck.size:
        # jump of a stuck node is on its cycle once 2^k >= n.
        on_cycle = int(jump[stuck[0]])
        raise ValueError(f"parents contain a cycle (through node {on_cycle}); every node must reach -1")
    return dist[:n]


def tree_depths(parents: npt.ArrayLike) -> IntArray:
    """Number of turns from the prompt down to each node, inclusive: a first turn has depth 1.

    Validates ``parents`` (range, cycles) like ``backup_credit``.
    """
    return depths_checked(as_parents(parents))


def leaf_mask(parents: npt.ArrayLike) -> BoolArray:
    """True for nodes that are nobody's parent (terminal turns, the K rewarded leaves)."""
    p = as_parents(parents)
    has_child = np.zeros(p.size, dtype=bool)
    has_child[p[p >= 0]] = True
    return ~has_child


def levels_deepest_first(depth: IntArray) -> list[IntArray]:
    """Node indices grouped by depth, deepest level first."""
    if depth.size == 0:
        return []
    order = np.argsort(-depth, kind="stable")
    d_sorted = depth[order]
    cuts = np.flatnonzero(np.diff(d_sorted)) + 1
    return np.split(order, cuts)
