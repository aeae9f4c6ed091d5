"""Rollout correction: importance weights for the gap between the behavior policy μ (the sampler's weights,
η versions old, in bf16 on another engine) and the proximal policy π_prox (the learner's weights when the
step starts, `algo.proximal=step_start`), docs/algorithm.md §11.1. Pure torch.

Per loss token t (T tokens; `unit` says which sequence each belongs to: a turn for TreeOPSD, a root-to-leaf
path for GRPO/GSPO/TreePO), r_t = π_prox(y_t)/μ(y_t) (log r_t clamped to ±20 before exp, as the losses do):

    none        w_t = 1
    token_tis   w_t = min(r_t, C)                               per-token truncated IS (C = algo.is_threshold)
    token_mask  w_t = 1 if lo ≤ r_t ≤ hi else 0                  per-token mask (icepop; algo.mask_band)
    geo_tis     w_t = min(exp(mean_{t'∈u} log r_t'), C)          the unit's geometric-mean ratio, truncated
    geo_mask    w_t = 1 if lo ≤ exp(mean_u log r) ≤ hi else 0    a whole unit kept or dropped (algo.geo_band)
    prod_tis    w_t = min(Π_{t'∈u} r_t', C)                      the unit's product ratio, truncated
    prod_mis    w_t = Π_u r if Π_u r ≤ C else 0                  the product ratio, the unit dropped above C
    tr_mask     w_t = 1 if max_{t'∈u} k3_t' ≤ δ else 0           a trust region (δ = algo.tr_bound): the
                                                                 unit dropped where a token's k3 leaves it

Only the product is the unit's likelihood ratio π_prox(y_u)/μ(y_u): untruncated it makes E_μ[w f(y_u)] =
E_π_prox[f(y_u)] for any f of the whole unit (a turn's credit V_i is one), so it is the unbiased turn-level
correction TreeOPSD needs; the token and geometric modes are unbiased only on one-token units
(docs/algorithm.md §11.1 derives where each is biased).

The weights are constants (no gradient). A token with w_t = 0 leaves the loss's numerator; the normalizer Z
(known before any forward, learner/minibatch.py) still counts it, so a masked token shrinks the step rather
than re-weighting the kept ones.
"""

from __future__ import annotations

from typing import Literal

import torch

from learner.baselines import LOG_RATIO_CLAMP

Mode = Literal["none", "token_tis", "token_mask", "geo_tis", "geo_mask", "prod_tis", "prod_mis", "tr_mask"]
UNIT_MODES = ("geo_tis", "geo_mask", "prod_tis", "prod_mis")  # one ratio per unit (tr_mask: a per-unit max)
TRUNCATED = ("token_tis", "geo_tis", "prod_tis")  # weights min(ratio, C)


def correction_weights(
    mode: Mode,
    proximal_logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    on: torch.Tensor,
    unit: torch.Tensor,
    threshold: float,
    band: tuple[float, float],
    tr_bound: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """[T] weights (float64, 0 off `on` or where a log-prob is not finite) and their sums (`stats`).

    Args: proximal_logp, behavior_logp [T]; on [T] bool, loss tokens; unit [T] long, the sequence of each
    token (any ids ≥ 0 where `on`); threshold C; band (lo, hi) of the mask modes; tr_bound δ of tr_mask.
    Stats (sums, so that micro-batches add up): `is_tokens`, `is_units`, `is_weight_sum`,
    `is_weight_sq_sum` (Σ w²: with the sum, the Kish effective sample size), `is_k3_sum` (Σ k3 over the
    tokens, k3 = r − 1 − log r: over is_units, a unit's drift summed over its tokens), `is_weight_max`,
    `is_clipped_tokens` (a truncated mode's tokens whose ratio exceeded C), `is_masked_tokens`,
    `is_masked_units` (units with no weight left: a masked unit, or for token_mask one whose every token
    left the band), `is_log_ratio_max` (the largest |log ratio| the weights were taken of: the product's
    spread grows with the unit's length)."""
    lp, blp = proximal_logp.detach().double(), behavior_logp.detach().double()
    ok = on & torch.isfinite(lp) & torch.isfinite(blp)
    log_r = torch.where(ok, lp - blp, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ids, slot = _units(unit, ok)
    n_units = int(ids.numel())
    k3 = torch.where(ok, torch.expm1(log_r) - log_r, 0.0)
    log_ratio = _unit_log_ratio(mode, log_r, ok, slot, n_units)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode == "tr_mask":  # the unit's largest token k3 against δ: 1 inside the trust region, 0 outside
        worst = torch.zeros(n_units + 1, dtype=k3.dtype, device=k3.device).scatter_reduce(0, slot, k3, "amax")
        ratio = (worst[slot] <= tr_bound).double()
    weight = torch.where(ok, _weights(mode, ratio, threshold, band), 0.0)
    clipped = ok & (ratio > threshold) if mode in TRUNCATED else torch.zeros_like(ok)
    masked = ok & (weight == 0)
    kept_per_unit = torch.zeros(n_units + 1, dtype=torch.float64, device=ok.device).index_add(
        0, slot, (ok & (weight > 0)).double()
    )[:n_units]
    return weight, {
        "is_tokens": float(ok.sum()),
        "is_units": float(n_units),
        "is_weight_sum": float(weight[ok].sum()),
        "is_weight_sq_sum": float((weight[ok] ** 2).sum()),
        "is_k3_sum": float(k3.sum()),
        "is_weight_max": float(weight[ok].max()) if bool(ok.any()) else 0.0,
        "is_clipped_tokens": float(clipped.sum()),
        "is_masked_tokens": float(masked.sum()),
        "is_masked_units": float((kept_per_unit == 0).sum()),
        "is_log_ratio_max": float(log_ratio[ok].abs().max()) if bool(ok.any()) else 0.0,
    }


def _unit_log_ratio(
    mode: Mode, log_r: torch.Tensor, ok: torch.Tensor, slot: torch.Tensor, n_units: int
) -> torch.Tensor:
    """[T] the log ratio each token's weight is taken of: its own (token modes), or its unit's sum (the
    product) or mean (the geometric mean) over the unit's `ok` tokens."""
    if mode not in UNIT_MODES:
        return log_r
    zeros = torch.zeros(n_units + 1, dtype=log_r.dtype, device=log_r.device)
    total = zeros.index_add(0, slot, log_r)
    if mode in ("geo_tis", "geo_mask"):
        total = total / zeros.index_add(0, slot, ok.double()).clamp(min=1.0)
    return total[slot]


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
    if mode in TRUNCATED:
        return ratio.clamp(max=threshold)
    if mode == "prod_mis":
        return torch.where(ratio <= threshold, ratio, 0.0)
    if mode == "tr_mask":  # already 1 inside the trust region, 0 outside
        return ratio
    if mode in ("token_mask", "geo_mask"):
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
