"""Rollout correction: importance weights for the gap between the behavior policy μ (the sampler's weights,
η versions old, in bf16 on another engine) and the proximal policy π_prox (the learner's weights when the
step starts, `algo.proximal=step_start`), docs/algorithm.md §11.1. Pure torch.

Per loss token t (T tokens; `unit` says which sequence each belongs to: a turn for TreeOPSD, a root-to-leaf
path for GRPO/GSPO/TreePO):

    log r_t  = log π_prox(y_t) − log μ(y_t)              (clamped to ±20 before exp, as the losses do)
    none       w_t = 1
    token_tis  w_t = min(r_t, C)                           truncated IS (C = algo.is_threshold)
    seq_is     w_t = min(exp(mean_{t' ∈ u} log r_t'), C)   the unit's geometric-mean ratio, truncated
    token_mask w_t = 1 if lo ≤ r_t ≤ hi else 0             (icepop; [lo, hi] = algo.mask_band)
    seq_mask   w_t = 1 if lo ≤ exp(mean_u log r) ≤ hi else 0   a whole unit kept or dropped

The weights are constants (no gradient). A token with w_t = 0 leaves the loss's numerator; the normalizer Z
(known before any forward, learner/minibatch.py) still counts it, so a masked token shrinks the step rather
than re-weighting the kept ones.
"""

from __future__ import annotations

from typing import Literal

import torch

from learner.baselines import LOG_RATIO_CLAMP

Mode = Literal["none", "token_tis", "seq_is", "token_mask", "seq_mask"]


def correction_weights(
    mode: Mode,
    proximal_logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    on: torch.Tensor,
    unit: torch.Tensor,
    threshold: float,
    band: tuple[float, float],
) -> tuple[torch.Tensor, dict[str, float]]:
    """[T] weights (float64, 0 off `on` or where a log-prob is not finite) and their sums (`stats`).

    Args: proximal_logp, behavior_logp [T]; on [T] bool, loss tokens; unit [T] long, the sequence of each
    token (any ids ≥ 0 where `on`); threshold C; band (lo, hi). Stats (sums, so that micro-batches add up):
    `is_tokens`, `is_units`, `is_weight_sum`, `is_weight_max`, `is_clipped_tokens` (token_tis: r > C;
    seq_is: every token of a unit with ratio > C), `is_masked_tokens`, `is_masked_units` (units with no
    weight left: a masked unit, or for token_mask one whose every token left the band)."""
    lp, blp = proximal_logp.detach().double(), behavior_logp.detach().double()
    ok = on & torch.isfinite(lp) & torch.isfinite(blp)
    log_r = torch.where(ok, lp - blp, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ids, slot = _units(unit, ok)
    n_units = int(ids.numel())
    token_ratio = torch.exp(log_r)
    if mode in ("seq_is", "seq_mask"):
        zeros = torch.zeros(n_units + 1, dtype=log_r.dtype, device=log_r.device)
        count = zeros.index_add(0, slot, ok.double())
        unit_ratio = torch.exp(zeros.index_add(0, slot, log_r) / count.clamp(min=1.0))
        ratio = unit_ratio[slot]
    else:
        ratio = token_ratio
    weight = _weights(mode, ratio, threshold, band)
    weight = torch.where(ok, weight, 0.0)
    clipped = ok & (ratio > threshold) if mode in ("token_tis", "seq_is") else torch.zeros_like(ok)
    masked = ok & (weight == 0)
    kept_per_unit = torch.zeros(n_units + 1, dtype=torch.float64, device=ok.device).index_add(
        0, slot, (ok & (weight > 0)).double()
    )[:n_units]
    return weight, {
        "is_tokens": float(ok.sum()),
        "is_units": float(n_units),
        "is_weight_sum": float(weight[ok].sum()),
        "is_weight_max": float(weight[ok].max()) if bool(ok.any()) else 0.0,
        "is_clipped_tokens": float(clipped.sum()),
        "is_masked_tokens": float(masked.sum()),
        "is_masked_units": float((kept_per_unit == 0).sum()),
    }


def _units(unit: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct unit ids of the `ok` tokens, and each token's slot among them (spare slot = count for
    the tokens outside `ok`)."""
    ids, inverse = torch.unique(torch.where(ok, unit, -1), return_inverse=True)
    has_spare = bool((~ok).any())
    if has_spare:  # id −1 sorts first: shift the others down, send the −1 tokens to the spare slot
        n = int(ids.numel()) - 1
        slot = torch.where(ok, inverse - 1, n)
        return ids[1:], slot.long()
    return ids, inverse.long()


def _weights(mode: Mode, ratio: torch.Tensor, threshold: float, band: tuple[float, float]) -> torch.Tensor:
    if mode == "none":
        return torch.ones_like(ratio)
    if mode in ("token_tis", "seq_is"):
        return ratio.clamp(max=threshold)
    if mode in ("token_mask", "seq_mask"):
        return ((ratio >= band[0]) & (ratio <= band[1])).double()
    raise ValueError(f"unknown rollout correction {mode!r}")


def mismatch_by_lag(
    proximal_logp: torch.Tensor, behavior_logp: torch.Tensor, on: torch.Tensor, lag: torch.Tensor
) -> dict[int, tuple[float, float, int]]:
    """Per version lag ℓ (of the turn each token belongs to): (Σ k1, Σ k3, n) of μ against π_prox over the
    `on` tokens with finite log-probs; k1 = log μ − log π_prox, k3 = r − 1 − log r with r = π_prox/μ
    (≥ 0; both estimate KL(μ ‖ π_prox))."""
    lp, blp = proximal_logp.detach().double(), behavior_logp.detach().double()
    ok = on & torch.isfinite(lp) & torch.isfinite(blp)
    d = lp - blp
    out: dict[int, tuple[float, float, int]] = {}
    for value in torch.unique(lag[ok]).tolist():
        sel = ok & (lag == value)
        ds = d[sel]
        out[int(value)] = (float((-ds).sum()), float((torch.expm1(ds) - ds).sum()), int(sel.sum()))
    return out
