"""The decisions of a step before any forward (learner/learner.py `Learner.plan`), as pure functions of the
config, the method and the version: which trees train, how they split into mini-batches, and each
mini-batch's targets. Every rank of the sharded learner computes the same from the same batch, so each
rank's share is over the same global normalizer (learner/sharded.py).

    kept = select_trees(algo, method, trees, version)       # refuses what cannot train; drops flat trees
    groups = minibatch_groups(seed, version, len(kept), n)  # whole trees per mini-batch, seeded
    targets = step_targets(algo, method, kept, groups)      # Z and per-tree advantages and weights
    packed = micro_inputs(trees, micro, lc, full, attention)  # one micro-batch's model inputs (CPU)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from configs.algo import AlgoConfig
from configs.schema import LearnerConfig
from learner.flex_attention import bucket_length
from learner.methods import Method
from learner.minibatch import MinibatchTargets, minibatch_targets, pack_microbatch
from learner.packing import PackedBatch
from system.credit import is_zero_variance, no_signal_stats
from system.depth_correction import depth_weights
from system.microbatch import Piece
from system.tree import RolloutTree


def select_trees(
    algo: AlgoConfig, method: Method, trees: Sequence[RolloutTree], version: int
) -> list[RolloutTree]:
    """The trees that train: refuses uncredited trees for a method that reads credit, and trees of another
    version when μ is recomputed (it is π at this version: it must be theirs); drops flat trees if asked."""
    if method.needs_credit and any(t.credit is None for t in trees):
        raise ValueError(f"{algo.method} needs credited trees (tree.credit from the backup actor)")
    if algo.behavior_logprobs == "recompute":
        stale = [t.tree_id for t in trees if (t.versions != version).any()]
        if stale:
            raise ValueError(
                f"algo.behavior_logprobs=recompute: trees {stale[:3]} hold turns sampled by another "
                f"version than the learner's {version}; recompute needs run.mode=sync"
            )
    drop = algo.zero_var_trees == "drop" or method.skips_flat_trees(algo)
    return [t for t in trees if not (drop and is_zero_variance(t))]


def selection_stats(trees: Sequence[RolloutTree], kept: Sequence[RolloutTree]) -> dict[str, float]:
    """How many trees train and how many were dropped, with the batch's no-signal counts."""
    stats = {"learner/trees": float(len(kept)), "learner/dropped_trees": float(len(trees) - len(kept))}
    return {**stats, **no_signal_stats(trees)}


def minibatch_groups(seed: int, version: int, n: int, minibatches: int) -> list[list[int]]:
    """Whole trees per mini-batch; the order depends only on (seed, version): a resumed run repeats it."""
    rng = np.random.default_rng([seed, version])
    order = rng.permutation(n)
    return [g.tolist() for g in np.array_split(order, minibatches) if len(g)]


def step_targets(
    algo: AlgoConfig, method: Method, kept: list[RolloutTree], groups: list[list[int]]
) -> list[MinibatchTargets]:
    """Per mini-batch, Z and the per-tree advantages and weights its micro-batches read
    (learner/minibatch.py). TreePO's Â is whitened over every path token of the whole rollout batch."""
    adv = method.leaf_advantages(kept)  # over the whole batch (TreePO whitens over all of it)
    weights = depth_weights(kept, algo.expected_cost) if algo.depth_correction else None
    return [
        minibatch_targets(
            algo.method,
            [kept[i] for i in g],
            None if adv is None else [adv[i] for i in g],
            None if weights is None else [weights[i] for i in g],
        )
        for g in groups
    ]


def micro_inputs(
    trees: list[RolloutTree], micro: Sequence[Piece], lc: LearnerConfig, full_paths: bool, attention: str
) -> PackedBatch:
    """One micro-batch's model inputs: one unpadded row unless the mask is materialized; for flex, padded to
    its length bucket (learner/flex_attention.py)."""
    packed = pack_microbatch(trees, micro, lc.packed_forward, full_paths, attention != "mask")
    if attention == "flex":
        packed = packed.padded_to(bucket_length(packed.input_ids.shape[1], lc.max_tokens_per_microbatch))
    return packed
