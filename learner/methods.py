"""The four methods as objects (docs/algorithm.md §5, §8): what each needs from a tree, its advantages, its
normalizer and its loss. The learner looks its method up once (`METHODS[algo.method]`) and never branches on
the name; adding a method is adding an object here.

    method = METHODS["grpo"]
    method.needs_credit                     # reads tree.credit (TreeOPSD's teacher)? then the backup must run
    adv = method.leaf_advantages(trees)     # per tree, its leaves' advantages (None: TreeOPSD has a teacher)
    z = method.normalizer(trees, weights)   # the mini-batch's Z, known before any forward
    on, unit, index = method.layout(packed) # the tokens its loss reads and their unit (turn or path)
    loss, stats = method.loss(algo, packed, logp, ref, c, targets)

Pure torch/numpy; `ref` is the loss's reference log-probs (μ, or π_prox), `c` the rollout correction's
weights over `layout`'s tokens (None: none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from configs.algo import AlgoConfig
from learner.baselines import grpo_advantages, gspo_loss, ppo_clip_loss, treepo_advantages
from learner.losses import treeopsd_loss
from learner.packing import PackedBatch
from system.microbatch import loss_token_counts, path_token_counts
from system.tree import RolloutTree


class Targets(Protocol):
    """What a loss reads of its mini-batch's tables (learner/minibatch.py's MinibatchTargets)."""

    z: float

    def at_leaves(self, packed: PackedBatch) -> torch.Tensor: ...
    def at_turns(self, packed: PackedBatch) -> torch.Tensor | None: ...


Tensor = torch.Tensor
Layout = tuple[Tensor, Tensor, Tensor | None]
Weights = Tensor | None
Result = tuple[Tensor, dict[str, float]]


@dataclass(frozen=True)
class PathTokens:
    """What a path loss reads of one micro-batch: the (token copy, path) pairs' log-probs under θ and the
    reference, the per-path advantages, which pairs are in the loss, each pair's path, the correction's
    weights (None: none) and Z."""

    lp: Tensor
    old: Tensor
    adv: Tensor
    on: Tensor
    unit: Tensor
    c: Weights
    z: float


def owned_turns(packed: PackedBatch) -> Layout:
    """Every trained turn once: (owned loss tokens, their turn id, None = the flat token stream)."""
    turn_ids = torch.where(packed.owned & (packed.turn_ids >= 0), packed.turn_ids, -1).flatten()
    return turn_ids >= 0, turn_ids, None


def path_counts(trees: Sequence[RolloutTree]) -> list[np.ndarray]:
    """Per tree, the loss tokens of each root-to-leaf path (what a path loss trains)."""
    return [np.asarray(path_token_counts(t, loss_token_counts(t)), dtype=np.float64) for t in trees]


def whiten_by_counts(values: Sequence[np.ndarray], counts: Sequence[np.ndarray], eps: float = 1e-8):
    """`masked_whiten` over tokens when value v_l repeats on c_l tokens: mean = Σ c v / N, the unbiased
    var = Σ c (v − mean)² / (N − 1) (N − 1 clamped to ≥ 1), (v − mean) / sqrt(var + eps)."""
    v, c = np.concatenate([np.zeros(0), *values]), np.concatenate([np.zeros(0), *counts])
    n = c.sum()
    mean = (c * v).sum() / max(n, 1.0)
    var = (c * (v - mean) ** 2).sum() / max(n - 1.0, 1.0)
    white = (v - mean) / np.sqrt(var + eps)
    return np.split(white, np.cumsum([len(x) for x in values])[:-1])


class TreeOPSD:
    """Per-turn forward KL to the tree teacher q_i (§5): the credit comes from the backup actor; Z = Σ w_i ℓ_i
    over every turn; the loss reads each owned turn once."""

    name, needs_credit, trains_paths = "treeopsd", True, False

    def skips_flat_trees(self, algo: AlgoConfig) -> bool:
        return False  # algo.zero_var_trees decides for every method

    def leaf_advantages(self, trees: Sequence[RolloutTree]) -> list[np.ndarray] | None:
        return None

    def normalizer(self, trees: Sequence[RolloutTree], turn_weights: Sequence[np.ndarray] | None) -> float:
        total = 0.0
        for k, t in enumerate(trees):
            ell = np.asarray(loss_token_counts(t), np.float64)
            total += float((ell * (1.0 if turn_weights is None else turn_weights[k])).sum())
        return total

    def layout(self, packed: PackedBatch) -> Layout:
        return owned_turns(packed)

    def loss(
        self,
        algo: AlgoConfig,
        packed: PackedBatch,
        logp: torch.Tensor,
        ref: torch.Tensor,
        c: torch.Tensor | None,
        targets: Targets,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        _, turn_ids, _ = self.layout(packed)
        loss, _ = treeopsd_loss(
            logp.flatten(),
            ref.flatten(),
            turn_ids,
            packed.q,
            z_total=targets.z,
            turn_weights=targets.at_turns(packed),
            token_weights=c,
        )
        return loss, {}


class _PathMethod:
    """A PPO-style baseline over every root-to-leaf path (§8): the advantage is the standardized leaf reward
    with the tree as the group, Z the path tokens, the loss a clipped ratio against `ref`."""

    name, needs_credit, trains_paths = "", False, True

    def skips_flat_trees(self, algo: AlgoConfig) -> bool:
        return False

    def leaf_advantages(self, trees: Sequence[RolloutTree]) -> list[np.ndarray] | None:
        out = []
        for t in trees:
            r = torch.from_numpy(np.asarray(t.leaf_rewards(), dtype=np.float64))
            out.append(grpo_advantages(r, torch.zeros(len(r), dtype=torch.long)).numpy())
        return out

    def normalizer(self, trees: Sequence[RolloutTree], turn_weights: Sequence[np.ndarray] | None) -> float:
        return float(sum(p.sum() for p in path_counts(trees)))

    def layout(self, packed: PackedBatch) -> Layout:
        return packed.effective_mask.flatten()[packed.pair_index], packed.pair_seq, packed.pair_index

    def loss(
        self,
        algo: AlgoConfig,
        packed: PackedBatch,
        logp: torch.Tensor,
        ref: torch.Tensor,
        c: torch.Tensor | None,
        targets: Targets,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        on, unit, index = self.layout(packed)
        assert index is not None
        lp, old = logp.flatten()[index], ref.flatten()[index]
        adv = targets.at_leaves(packed).to(lp.device)
        loss, st = self.clipped(algo, PathTokens(lp, old, adv, on, unit, c, targets.z))
        out = {k: st[k] for k in ("clip_frac", "dual_clip_frac") if k in st}
        return loss, {**out, "clip_n": st.get("num_seqs", st.get("num_tokens", 0.0))}

    def clip_range(self, algo: AlgoConfig) -> tuple[float, float]:
        raise NotImplementedError

    def clipped(self, algo: AlgoConfig, t: PathTokens) -> Result:
        """Token-level PPO-clip over every path copy (GRPO, TreePO), with the dual clip when asked."""
        clip_c = algo.dual_clip_c if algo.dual_clip else None
        return ppo_clip_loss(
            t.lp,
            t.old,
            t.adv[t.unit],
            t.on,
            *self.clip_range(algo),
            z_total=t.z,
            clip_c=clip_c,
            is_weights=t.c,
        )


class GRPO(_PathMethod):
    name = "grpo"

    def clip_range(self, algo: AlgoConfig) -> tuple[float, float]:
        return algo.grpo_clip


class GSPO(_PathMethod):
    """Sequence-level ratio; Z = the number of leaves whose path has a loss token (a sequence mean)."""

    name = "gspo"

    def normalizer(self, trees: Sequence[RolloutTree], turn_weights: Sequence[np.ndarray] | None) -> float:
        return float(sum(int((p > 0).sum()) for p in path_counts(trees)))

    def clipped(self, algo: AlgoConfig, t: PathTokens) -> Result:
        """Sequence-level ratio per path (its advantage is per sequence, not per token)."""
        seq = torch.where(t.on, t.unit, -1)
        return gspo_loss(t.lp, t.old, t.adv, seq, *algo.gspo_clip, z_total=t.z, is_weights=t.c)


class TreePO(_PathMethod):
    """Per-leaf Â averaged over the groups of its path (§8.3), whitened over every path token of the whole
    rollout batch; `algo.treepo_filter_zero_std` also drops trees without signal."""

    name = "treepo"

    def skips_flat_trees(self, algo: AlgoConfig) -> bool:
        return algo.treepo_filter_zero_std

    def leaf_advantages(self, trees: Sequence[RolloutTree]) -> list[np.ndarray] | None:
        raw = [treepo_advantages(t.turn_parents(), t.leaf_rewards())[1] for t in trees]
        return whiten_by_counts(raw, path_counts(trees))

    def clip_range(self, algo: AlgoConfig) -> tuple[float, float]:
        return algo.treepo_clip


Method = TreeOPSD | GRPO | GSPO | TreePO
METHODS: dict[str, Any] = {m.name: m for m in (TreeOPSD(), GRPO(), GSPO(), TreePO())}
