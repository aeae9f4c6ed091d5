"""What the learner logs about each mini-batch and step (pure torch; called by learner/learner.py's loop):

mismatch_sums(packed, logp)       Σ k1, Σ k3, n: sampler vs learner log-probs on the owned loss tokens
                                  (without a proximal policy the first mini-batch's, at the step's start:
                                  `learner/mismatch_kl` over lag-0 turns, `mismatch/k1`, `k3` over all)
turn_diagnostics(packed, logp)    TreeOPSD's per-turn view for every method (|s|, overshoot, KL to target)
combine_microbatches(parts)       one mini-batch's stats from its micro-batches' (sums, maxima, exact means)
summarize_minibatches(per_mb)     the step's `learner/...` scalars, per mini-batch index and overall
"""

from __future__ import annotations

import numpy as np
import torch

from learner.losses import treeopsd_loss
from learner.packing import PackedBatch


def mismatch_sums(
    packed: PackedBatch, logp: torch.Tensor, version: int | None = None
) -> tuple[float, float, int]:
    """(Σ k1, Σ k3, n) over owned loss tokens with finite μ: k1 = log μ − log π, k3 = r − 1 − log r.

    With `version` (the weights `logp` was computed with), only over turns sampled by that version: the
    sampler/learner mismatch at equal weights. A stale turn's gap is the policy's own change since it was
    sampled (async runs), which importance ratios correct and which would hide the numerical mismatch."""
    on = packed.owned & packed.effective_mask
    if version is not None:
        sampled_by = packed.turn_version.to(packed.turn_ids.device)[packed.turn_ids.clamp(min=0)]
        on = on & (sampled_by == version)
    d = (logp[on] - packed.behavior_logp[on]).double()  # log r = log π − log μ
    return float((-d).sum()), float((torch.expm1(d) - d).sum()), int(on.sum())


def turn_diagnostics(
    packed: PackedBatch, logp: torch.Tensor, ref: torch.Tensor | None = None, c: torch.Tensor | None = None
) -> dict[str, float]:
    """TreeOPSD's per-turn view for every method: mean |s|, overshoot fraction, KL to the teacher, with s
    against the loss's reference `ref` (learner/minibatch.py `loss_reference`: π_prox when the step scored
    one, else μ; default: μ) and, for TreeOPSD, the rollout correction's token weights `c` as its loss
    weighs them (None: unweighted)."""
    on = packed.owned & (packed.turn_ids >= 0)
    turn_ids = torch.where(on, packed.turn_ids, -1).flatten()
    ref = packed.behavior_logp if ref is None else ref
    _, st = treeopsd_loss(logp.flatten(), ref.flatten(), turn_ids, packed.q, token_weights=c)
    keys = ["mean_abs_s", "max_abs_s", "num_turns", "num_tokens", "nonfinite_tokens"]
    if packed.credited:  # relative to a teacher only when there is one (baselines may skip the backup)
        keys += ["overshoot_frac", "kl_to_target"]
    return {k: st[k] for k in keys}


def combine_microbatches(parts: list[dict[str, float]]) -> dict[str, float]:
    """Micro-batch stats → the mini-batch's: the loss shares and counts add up, maxima take the max, turn
    means are weighted by turns, token means by loss tokens, clip fractions by what they count over."""
    out: dict[str, float] = {}
    add = ("loss", "tokens", "num_turns", "num_tokens", "nonfinite_tokens", "weighted_tokens")
    for key in (
        *add,
        "mismatch_k1_sum",
        "mismatch_k3_sum",
        "mismatch_n",
        "all_k1_sum",
        "all_k3_sum",
        "all_n",
    ):
        if all(key in p for p in parts):
            out[key] = sum(p[key] for p in parts)
    out["max_abs_s"] = max(p["max_abs_s"] for p in parts)
    by = {"mean_abs_s": "num_turns", "overshoot_frac": "num_turns", "kl_to_target": "num_tokens"}
    by.update({"clip_frac": "clip_n", "dual_clip_frac": "clip_n"})
    for key, weight in by.items():
        if all(key in p for p in parts):
            w = [p.get(weight, 0.0) for p in parts]
            out[key] = sum(p[key] * x for p, x in zip(parts, w, strict=True)) / max(sum(w), 1e-300)
    if "mismatch_n" in out:  # left out when no token was sampled by the learner's weights: nothing measured
        k1, k3, n = out.pop("mismatch_k1_sum"), out.pop("mismatch_k3_sum"), out.pop("mismatch_n")
        if n > 0:
            out.update(mismatch_kl=k1 / n, mismatch_kl_k3=k3 / n, mismatch_tokens=n)
    if "all_n" in out:  # every turn against the step-start weights, whatever version sampled it
        k1, k3, n = out.pop("all_k1_sum"), out.pop("all_k3_sum"), out.pop("all_n")
        if n > 0:
            out.update({"mismatch/k1": k1 / n, "mismatch/k3": k3 / n, "mismatch/tokens": n})
    return out


def summarize_minibatches(per_mb: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, st in enumerate(per_mb):
        for key in ("loss", "mean_abs_s", "overshoot_frac", "kl_to_target", "grad_norm", "clip_frac"):
            if key in st:
                out[f"learner/mb{k}/{key}"] = st[key]
        for key in ("mismatch_kl", "mismatch_kl_k3", "mismatch_tokens"):
            if key in st:
                out[f"learner/{key}"] = st[key]
        out.update({key: st[key] for key in ("mismatch/k1", "mismatch/k3", "mismatch/tokens") if key in st})
    if not per_mb:
        return {"learner/loss": 0.0, "learner/grad_norm": 0.0, "learner/tokens": 0.0}
    n_tok = sum(st["num_tokens"] for st in per_mb)
    if all("kl_to_target" in st for st in per_mb):
        kl = sum(st["kl_to_target"] * st["num_tokens"] for st in per_mb) / max(n_tok, 1.0)
        out["learner/kl_to_target"] = kl
    out.update(
        {
            "learner/loss": float(np.mean([st["loss"] for st in per_mb])),
            "learner/grad_norm": float(np.mean([st["grad_norm"] for st in per_mb])),
            "learner/tokens": float(sum(st["tokens"] for st in per_mb)),
            "learner/loss_tokens": float(n_tok),
            "learner/max_abs_s": float(max(st["max_abs_s"] for st in per_mb)),
            "learner/nonfinite_tokens": float(sum(st["nonfinite_tokens"] for st in per_mb)),
            "learner/skipped_minibatches": float(sum(st.get("skipped", 0.0) for st in per_mb)),
        }
    )
    return out


def padding_stats(batches: list) -> dict[str, float]:
    """`learner/pad_frac`: padding columns over all columns forwarded this step (the flex kernel's length
    buckets; 0 for the unpadded layouts), and `learner/forwarded_tokens`, real tokens forwarded. Entries
    that are not a PackedBatch (the sharded learner's padding passes) are skipped."""
    columns = real = 0
    for p in batches:
        if isinstance(p, PackedBatch):
            columns += p.input_ids.numel()
            real += p.num_tokens
    return {"learner/pad_frac": (columns - real) / max(columns, 1), "learner/forwarded_tokens": float(real)}


def nonfinite_turns(batches: list[PackedBatch]) -> list[int]:
    """[turns with a non-finite μ on an owned loss token, turns] over `batches` (docs/algorithm.md §10)."""
    affected = total = 0
    for p in batches:
        on = p.owned & (p.turn_ids >= 0)
        bad = on & ~torch.isfinite(p.behavior_logp)
        total += int(torch.unique(p.turn_ids[on]).numel())
        affected += int(torch.unique(p.turn_ids[bad]).numel())
    return [affected, total]


def microbatch_stats(
    packed: PackedBatch,
    logp: torch.Tensor,
    stats: dict[str, float],
    version: int | None,
    reference: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> dict[str, float]:
    """One micro-batch's stats (the parts `combine_microbatches` adds up): its loss stats and turn
    diagnostics against `reference` = (ref, c), the loss's reference and TreeOPSD's token weights (None: μ,
    unweighted); with `version` (the step's first forward, at its starting weights), the mismatch sums over
    the turns sampled at that version and over every turn."""
    st = {**stats, **turn_diagnostics(packed, logp, *(reference or (None, None)))}
    if version is not None:
        a, b, n = mismatch_sums(packed, logp, version)
        st.update(mismatch_k1_sum=a, mismatch_k3_sum=b, mismatch_n=float(n))
        a, b, n = mismatch_sums(packed, logp)
        st.update(all_k1_sum=a, all_k3_sum=b, all_n=float(n))
    return st
