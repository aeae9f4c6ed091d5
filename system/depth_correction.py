"""Depth correction (`algo.depth_correction`, off by default; docs/algorithm.md §5.3): per-turn weights that
give every depth of a batch of trees the weight it would carry under flat sampling at the same cost.

Why: a branch from anchor k adds turns at depths k+1, k+2, …, never at depth 1, so an initialize–expand tree
holds more deep turns than the same budget of independent trajectories: with anchors uniform on 1..T−1, a
(4,2) tree has 4 turns at depth 1 and up to 12 at depth T, where 8 flat trajectories have 8 at every depth
they reach. The tree loss, a sum over turns, weights deep turns up in that proportion.

The correction, over a batch of trees (pooled, so that rare depths still have a reference):

    p_d   = share of the batch's trunks (the M initial trajectories of each tree) that reach depth d
    f_d   = B · C · p_d          turns at depth d that B·C flat trajectories would have (C = cost per prompt,
                                 M(1 + N/2) full trajectories, docs/algorithm.md §2.3)
    n_d   = turns at depth d in the batch's trees (trunks and branches)
    w_d   = f_d / n_d            the weight of every turn at depth d (0 where no trunk reaches d)

A batch of flat groups (N = 0, C = M) gets w ≡ 1. The trunks are found by construction: trunks are sampled
before any branch, so at every node the trunk goes on through its smallest-id child (actors/tree_sampler.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from system.tree import ROOT, RolloutTree


def trunk_lengths(tree: RolloutTree) -> list[int]:
    """Turns on each initial trajectory: from each first turn, down the smallest-id child to a leaf."""
    lengths = []
    for first in tree.children[ROOT]:
        node, n = first, 1
        while tree.children[node]:
            node, n = min(tree.children[node]), n + 1
        lengths.append(n)
    return lengths


def depth_weights(trees: Sequence[RolloutTree], cost: float) -> list[np.ndarray]:
    """Per tree, a float64 weight per node (root included, weight 0 there) as in the module docstring."""
    if not trees:
        return []
    trunks = np.array([n for t in trees for n in trunk_lengths(t)], dtype=np.int64)
    depths = [np.array([n.depth for n in t.nodes], dtype=np.int64) for t in trees]
    deepest = int(max(d.max() for d in depths))
    reach = np.array([(trunks >= d).mean() for d in range(deepest + 1)])  # p_d; index 0 unused
    counts = np.bincount(np.concatenate([d[1:] for d in depths]), minlength=deepest + 1)  # n_d
    flat = len(trees) * cost * reach  # f_d
    per_depth = np.divide(flat, counts, out=np.zeros(deepest + 1), where=counts > 0)
    per_depth[0] = 0.0  # the root is not a turn
    return [per_depth[d] for d in depths]
