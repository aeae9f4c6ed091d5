"""One mini-batch's loss targets and normalizers, computed once from its whole trees, then read by each of its
token-budget micro-batches (docs/design.md §11; pure torch/numpy).

    targets = minibatch_targets(method, trees, leaf_adv, weights)   # Z and per-node tables
    for micro in plan_microbatches(trees, budget, packed=True):
        packed = pack_microbatch(trees, micro, packed=True, full=...)
        ref, c = loss_reference(cfg.algo, packed)                       # μ or π_prox, the correction
        loss, st = METHODS[cfg.algo.method].loss(cfg.algo, packed, logp, ref, c, targets)  # Σ = one-shot
        loss.backward()                                              # gradients accumulate

The accumulated gradient equals the one-shot gradient because every denominator is global to the mini-batch
and known before any forward (system/microbatch.py counts the loss tokens without the model; each method's
`normalizer`, learner/methods.py):

    treeopsd  Z = Σ_i w_i ℓ_i over every turn of the mini-batch (w ≡ 1 without the depth correction)
    grpo      Z = Σ_leaves (loss tokens on the root-to-leaf path)       token mean over every path copy
    treepo    the same Z; the whitening of Â uses every path token of the whole rollout batch
    gspo      Z = number of leaves whose path has a loss token           sequence mean

and the per-tree quantities (GRPO's group = the tree, TreePO's Â, the depth weights) are looked up per
(tree, node) rather than recomputed from what a micro-batch happens to hold. The sharded learner sums Z
over ranks the same way. A loss token whose *model* log-prob is non-finite is dropped from the sum but
still counted in Z (the one-shot loss counts it in ℓ_i; such batches are refused upstream, §10).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from configs.algo import AlgoConfig
from learner.methods import METHODS
from learner.packing import PackedBatch, pack_paths, pack_pieces
from learner.rollout_correction import correction_weights
from system.microbatch import (
    Piece,
    first_fit_decreasing,
    node_tokens,
    split_tree,
)
from system.tree import RolloutTree


@dataclass(frozen=True)
class MinibatchTargets:
    """Per-node tables of one mini-batch (tree k's node j at `offsets[k] + j`) and its normalizer Z."""

    offsets: torch.Tensor  # [n_trees] long
    leaf_adv: torch.Tensor | None  # [Σ nodes] float64: GRPO/GSPO/TreePO advantage at leaves, 0 elsewhere
    turn_w: torch.Tensor | None  # [Σ nodes] float64 depth weights, or None (w ≡ 1)
    z: float
    tree_ids: tuple[str, ...] = ()  # the mini-batch's trees in order (packed.turn_tree indexes them)

    def at_leaves(self, packed: PackedBatch) -> torch.Tensor:
        assert self.leaf_adv is not None
        return self.leaf_adv[self.offsets[packed.leaf_tree] + packed.leaf_node]

    def at_turns(self, packed: PackedBatch) -> torch.Tensor | None:
        if self.turn_w is None:
            return None
        return self.turn_w[self.offsets[packed.turn_tree] + packed.turn_node]


def minibatch_targets(
    method: str,
    trees: Sequence[RolloutTree],
    leaf_adv: Sequence[np.ndarray] | None,
    turn_weights: Sequence[np.ndarray] | None,
) -> MinibatchTargets:
    """Tables and Z (module docstring) of one mini-batch; `leaf_adv`/`turn_weights` per tree, per leaf
    (ascending) and per node (index 0 = the root, unused)."""
    sizes = [len(t.nodes) for t in trees]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    adv = None
    if leaf_adv is not None:
        adv = np.zeros(sum(sizes))
        for off, t, a in zip(offsets, trees, leaf_adv, strict=True):
            adv[off + t.leaves] = a
    w = None if turn_weights is None else np.concatenate([np.asarray(x, np.float64) for x in turn_weights])
    return MinibatchTargets(
        offsets=torch.from_numpy(offsets),
        leaf_adv=None if adv is None else torch.from_numpy(adv),
        turn_w=None if w is None else torch.from_numpy(w),
        z=METHODS[method].normalizer(trees, turn_weights),
        tree_ids=tuple(t.tree_id for t in trees),
    )


def plan_microbatches(trees: Sequence[RolloutTree], budget: int, packed: bool) -> list[list[Piece]]:
    """Micro-batches of one mini-batch under `budget` tokens (≤ 0: one): its pieces, first-fit-decreasing."""
    return first_fit_decreasing(microbatch_pieces(trees, budget, packed), budget)


def microbatch_pieces(trees: Sequence[RolloutTree], budget: int, packed: bool) -> list[Piece]:
    """Tree-packed: pieces from `split_tree` (a tree over budget becomes subtrees with their ancestors as
    context). Path layout: one piece per root-to-leaf sequence, sized by its tokens (each sequence is
    independent, so a tree's paths may land in different micro-batches; `owned` holds its leaf)."""
    if packed:
        return [p for k, t in enumerate(trees) for p in split_tree(k, t, budget)]
    out = []
    for k, t in enumerate(trees):
        sizes = node_tokens(t)
        for leaf in (int(f) for f in t.leaves):
            path = (0, *t.path(leaf))
            out.append(Piece(k, path, frozenset({leaf}), sum(sizes[j] for j in path), 0))
    return out


def pack_microbatch(
    trees: Sequence[RolloutTree], micro: Sequence[Piece], packed: bool, full: bool, concat: bool
) -> PackedBatch:
    """The model inputs of one micro-batch; tree and leaf indices refer to the whole mini-batch `trees`."""
    if packed:
        return pack_pieces(trees, micro, concat=concat)
    used = sorted({p.tree for p in micro})
    sequences = {(p.tree, leaf) for p in micro for leaf in p.owned}
    return pack_paths(trees, full=full, concat=concat, only=used, sequences=sequences)


def correction(algo: AlgoConfig, packed: PackedBatch) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The rollout correction's weights over the method's loss layout (`Method.layout`) and their sums;
    (None, {}) with algo.rollout_correction = none."""
    if algo.rollout_correction == "none":
        return None, {}
    if packed.proximal_logp is None:
        raise ValueError("algo.rollout_correction needs the proximal log-probs scored at the step's start")
    on, unit, index = METHODS[algo.method].layout(packed)
    prox, behavior = packed.proximal_logp.flatten(), packed.behavior_logp.flatten()
    if index is not None:
        prox, behavior = prox[index], behavior[index]
    mode = algo.rollout_correction
    band = algo.geo_band if mode == "geo_mask" else algo.mask_band
    return correction_weights(  # type: ignore[arg-type]
        mode, prox, behavior, on, unit, algo.is_threshold, band, algo.tr_bound
    )


def weighted_tokens(packed: PackedBatch, weights: torch.Tensor | None) -> dict[str, float]:
    """A micro-batch's token counts for the learner's stats: `tokens` forwarded, and `weighted_tokens`, the
    loss tokens the correction left a weight (all forwarded tokens without one). A mini-batch whose every
    micro-batch has none takes no optimizer step."""
    kept = float(packed.num_tokens) if weights is None else float((weights > 0).sum())
    return {"tokens": float(packed.num_tokens), "weighted_tokens": kept}


def loss_reference(algo: AlgoConfig, packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a micro-batch's loss is taken against: the reference log-probs (π_prox when the step scored one,
    algo.proximal=step_start, else the stored μ) and the rollout correction's weights (None: off).

    A token whose stored μ is not finite is not in Z (system/microbatch.py `loss_token_counts`), so it leaves
    the numerator too: its π_prox reads NaN, which every loss drops (and counts as a non-finite token)."""
    if packed.proximal_logp is None:
        return packed.behavior_logp, correction(algo, packed)[0]
    ref = torch.where(torch.isfinite(packed.behavior_logp), packed.proximal_logp, float("nan"))
    return ref, correction(algo, packed)[0]
