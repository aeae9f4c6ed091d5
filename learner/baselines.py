"""Baseline losses and advantages: GRPO, GSPO and TreePO-style (docs/algorithm.md §8). Pure torch / numpy.

Losses return ``(loss, stats)`` with detached python-float stats; nothing logs. Shapes:

    T        tokens of the micro-batch (any shape works for the token-level losses, e.g. [B, L])
    mask     same shape as logp; nonzero = a model token in the loss (env/prompt/padding tokens are 0)
    seq_ids  [T] long sequence index in [0, n_seq) of each token, -1 = not in the loss (GSPO)

Probability ratios are formed from log-ratios clamped to [-20, 20] (as verl does) so that a stray
large log-ratio cannot overflow exp; beyond the clamp the gradient is zero.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from system.credit import STD_EPS, ZERO_STD

LOG_RATIO_CLAMP = 20.0


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 are upcast: docs/algorithm.md §10)."""
    dtype = torch.float32
    for t in tensors:
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """GRPO outcome advantage A_j = (R_j − mean_g R) / (sd₁_g(R) + 1e-6) per group g (§8.1).

    Args:
        rewards: [B] float rewards, one per trajectory.
        group_ids: [B] integer group (prompt) label of each trajectory; any values, not necessarily 0..G-1.
    Returns [B] advantages (compute dtype, no grad). sd₁ is the sample std (ddof = 1). Groups with fewer than
    two members or sd₁ < 1e-12 get A = 0 (§3.1/§10: no signal, no 0/ε amplification of rounding noise).
    """
    with torch.no_grad():
        r = rewards.to(compute_dtype(rewards))
        _, g = torch.unique(group_ids, return_inverse=True)
        n_groups = int(g.max()) + 1 if g.numel() else 0
        zeros = torch.zeros(n_groups, dtype=r.dtype, device=r.device)
        count = zeros.index_add(0, g, torch.ones_like(r))
        mean = zeros.index_add(0, g, r) / count
        dev = r - mean[g]
        var = zeros.index_add(0, g, dev * dev) / (count - 1).clamp(min=1)
        std = var.sqrt()
        ok = (count >= 2) & (std >= ZERO_STD)
        adv = dev / (std[g] + STD_EPS)
        return torch.where(ok[g], adv, 0.0)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    *,
    z_total: float | torch.Tensor | None = None,
    clip_c: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip, token-mean: L = −(1/Z) Σ_t m_t min(κ_t A_t, clip(κ_t, 1−ε_lo, 1+ε_hi) A_t).

    κ_t = exp(logp_t − old_logp_t); Z = Σ_t m_t unless ``z_total`` overrides it (global normalizer).
    ``clip_c`` (> 1, verl's ``clip_ratio_c``; None: off): dual clip — where A_t < 0 the objective is at least
    c·A_t, so a token whose ratio ran far above 1 on a bad action cannot dominate the loss.
    ``advantages`` must broadcast to ``logp``'s shape. Masked-out positions may hold any value (even NaN).
    ``is_weights`` (same shape, constants; learner/rollout_correction.py): each token's objective times
    c_t; a token with c_t = 0 leaves the sum and the stats (Z keeps counting it). ``old_logp`` is then
    the proximal policy's, the trust region's centre (decoupled PPO).
    Stats over masked tokens: clip_frac (the clipped branch is strictly smaller, so the token has zero
    gradient), ratio_mean, approx_kl (k3 = mean(κ − 1 − log κ) ≥ 0, an estimate of KL(π_old || π_θ)),
    num_tokens.
    """
    dtype = compute_dtype(logp, old_logp, advantages)
    m = mask != 0
    weight = None if is_weights is None else torch.where(m, is_weights.detach().to(dtype), 0.0)
    if weight is not None:
        z_total, m = (float(m.sum()) if z_total is None else z_total), m & (weight > 0)
    lp = torch.where(m, logp.to(dtype), 0.0)
    old = torch.where(m, old_logp.detach().to(dtype), 0.0)
    adv = torch.where(m, advantages.detach().to(dtype), 0.0)
    log_ratio = (lp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss, stats = _clipped_objective(ratio, adv, m, (clip_low, clip_high), z_total, clip_c, weight)
    n = stats.pop("n")
    with torch.no_grad():
        k3 = float(torch.where(m, ratio - 1.0 - log_ratio, 0.0).sum()) / max(n, 1.0)
    return loss, {**stats, "approx_kl": k3, "num_tokens": n}


def _clipped_objective(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    on: torch.Tensor,
    clip: tuple[float, float],
    z_total: float | torch.Tensor | None,
    clip_c: float | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """−(1/Z) Σ_on w min(r A, clip(r, 1−ε_lo, 1+ε_hi) A) (with `clip_c`: at least c·A where A < 0), Z = the
    count of `on` unless `z_total` overrides it, w ≡ 1 unless given; stats: clip_frac, dual_clip_frac,
    ratio_mean, n."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip[0], 1.0 + clip[1]) * adv
    obj = torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(on)
    if clip_c is not None:
        floor = clip_c * adv
        dual = (adv < 0) & (obj < floor)
        obj = torch.where(dual, floor, obj)
    obj = torch.where(on, obj if weight is None else weight * obj, 0.0)
    n = float(on.sum())
    z = torch.as_tensor(n if z_total is None else z_total, dtype=ratio.dtype, device=ratio.device)
    loss = -obj.sum() / torch.where(z > 0, z, torch.ones_like(z))
    with torch.no_grad():
        denom = max(n, 1.0)
        return loss, {
            "clip_frac": float(((clipped < unclipped) & on).sum()) / denom,
            "dual_clip_frac": float((dual & on).sum()) / denom,
            "ratio_mean": float(torch.where(on, ratio, 0.0).sum()) / denom,
            "n": n,
        }


# GRPO (§8.1): token-level PPO-clip, token-mean, ε_lo = ε_hi = 0.2, optional dual clip; `advantages` per
# token (A_j broadcast to every model token of trajectory j). The learner passes its configured clip range
# to ``ppo_clip_loss`` itself (learner/methods.py); these two are the paper's defaults.
grpo_loss = functools.partial(ppo_clip_loss, clip_low=0.2, clip_high=0.2)
# TreePO (§8.3): PPO-clip token-mean with ε_lo = 0.2, ε_hi = 0.28 over root-to-leaf path sequences (one
# sequence per leaf, shared prefixes repeated, each copy masked in; advantages from ``treepo_advantages``
# + ``masked_whiten``).
treepo_loss = functools.partial(ppo_clip_loss, clip_low=0.2, clip_high=0.28)


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages_per_seq: torch.Tensor,
    seq_ids: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    *,
    z_total: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO loss (§8.2), sequence-mean: L = −(1/|B|) Σ_j min(s_j A_j, clip(s_j, 1−ε_lo, 1+ε_hi) A_j).

    Args:
        logp, old_logp: [T] per-token log-probs (current, behavior).
        advantages_per_seq: [n_seq] A_j.
        seq_ids: [T] long sequence index of each token, -1 = not a loss token.
        z_total: overrides |B| (e.g. the global number of sequences).
        is_weights: [T] token weights c_t of the rollout correction: tokens with c_t = 0 leave s_j, and
            sequence j's objective is multiplied by the mean c_t over its remaining tokens (the sequence
            modes give every token of j the same c). None: c ≡ 1.
    s_j = exp(mean over seq j's finite loss tokens of (logp − old_logp)); sequences with no such token are
    left out of the sum and of |B|. Stats: clip_frac (fraction of sequences whose clip binds), ratio_mean,
    num_seqs, nonfinite_tokens.
    """
    dtype = compute_dtype(logp, old_logp, advantages_per_seq)
    n_seq = advantages_per_seq.shape[0]
    if seq_ids.numel() and int(seq_ids.max()) >= n_seq:
        raise ValueError(f"seq_ids reach {int(seq_ids.max())} but there are {n_seq} sequence advantages")
    lp, old = logp.to(dtype), old_logp.detach().to(dtype)
    in_loss = seq_ids >= 0
    ok = in_loss & torch.isfinite(lp) & torch.isfinite(old)
    c = None if is_weights is None else torch.where(ok, is_weights.detach().to(dtype), 0.0)
    if c is not None:  # |B| counts the sequences a mask empties (the normalizer is fixed before it)
        z_total = float(torch.unique(seq_ids[ok]).numel()) if z_total is None else z_total
        ok = ok & (c > 0)
    diff = torch.where(ok, lp, 0.0) - torch.where(ok, old, 0.0)
    slot = torch.where(in_loss, seq_ids, n_seq).long()  # spare slot n_seq for non-loss tokens
    zeros = torch.zeros(n_seq + 1, dtype=dtype, device=logp.device)
    ell = zeros.index_add(0, slot, ok.to(dtype))[:n_seq]
    active = ell > 0
    seq_w = None if c is None else zeros.index_add(0, slot, c)[:n_seq] / ell.clamp(min=1.0)
    mean_lr = zeros.index_add(0, slot, diff)[:n_seq] / ell.clamp(min=1.0)
    log_ratio = mean_lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = torch.where(active, advantages_per_seq.detach().to(dtype), 0.0)
    loss, stats = _clipped_objective(ratio, adv, active, (clip_low, clip_high), z_total, weight=seq_w)
    n = stats.pop("n")
    return loss, {**stats, "num_seqs": n, "nonfinite_tokens": float((in_loss & ~ok).sum())}


def treepo_advantages(
    parents: Sequence[int] | np.ndarray, leaf_rewards: Sequence[float] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """TreePO per-leaf advantage (§8.3, the official "average" strategy adapted to turns). numpy, float64.

    Args:
        parents: [n_nodes] parent turn index of each turn node, -1 for the root's children (first turns).
            Parents may come in any order; the structure must be a forest (no cycles).
        leaf_rewards: either [n_leaves], the rewards of the leaves in ascending node-index order, or
            [n_nodes], indexed by node (only the leaf entries are read). Leaves are nodes without children.
    Returns ``(leaves, adv)``: leaves [K] int64 ascending node ids, adv [K] float64.

    For leaf i with path a_1..a_D (root excluded) and depth d ∈ {0, …, D−1}, G_{i,d} = leaves whose path
    shares a_1..a_d (G_{i,0} = all K leaves; for d ≥ 1 the leaves under a_d). d = 0 is always included, d ≥ 1
    only if |G_{i,d}| > 1; an unbranched stretch yields the same group at consecutive depths and it is counted
    at each of them. Â_i = mean over included d of (R_i − mean_{k ∈ G_{i,d}} R_k). No per-group std.
    """
    par = np.asarray(parents, dtype=np.int64).reshape(-1)
    n = par.shape[0]
    has_child = np.zeros(n, dtype=bool)
    has_child[par[par >= 0]] = True
    leaves = np.flatnonzero(~has_child)
    r = np.asarray(leaf_rewards, dtype=np.float64).reshape(-1)
    if r.shape[0] == n:
        r = r[leaves]
    elif r.shape[0] != leaves.shape[0]:
        raise ValueError(
            f"leaf_rewards has {r.shape[0]} entries; expected {leaves.shape[0]} leaves or {n} nodes"
        )
    # Sum and count of leaf rewards under every node: push each leaf's reward up its ancestor chain.
    sub_sum = np.zeros(n)
    sub_cnt = np.zeros(n, dtype=np.int64)
    paths = []
    for leaf, rew in zip(leaves, r, strict=True):
        path: list[int] = []
        node = int(leaf)
        while node >= 0:
            if len(path) > n:
                raise ValueError("parents contain a cycle")
            path.append(node)
            sub_sum[node] += rew
            sub_cnt[node] += 1
            node = int(par[node])
        paths.append(path[::-1])  # a_1 .. a_D
    adv = np.empty(leaves.shape[0])
    root_mean = float(r.mean()) if r.size else 0.0
    for k, (path, rew) in enumerate(zip(paths, r, strict=True)):
        terms = [rew - root_mean]  # d = 0
        for node in path[:-1]:  # d = 1 .. D-1: the group under a_d
            if sub_cnt[node] > 1:
                terms.append(rew - sub_sum[node] / sub_cnt[node])
        adv[k] = float(np.mean(terms))
    return leaves, adv


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Token-level whitening over masked entries, as verl's ``masked_whiten`` (shift_mean=True).

    (values − mean) / sqrt(var + eps) with the masked mean and the unbiased (ddof = 1) masked variance, so
    the masked entries end with mean 0 and sample std 1 (up to eps). Entries outside the mask are set to 0.
    No grad. With fewer than two masked entries the variance is taken as 0.
    """
    with torch.no_grad():
        m = mask != 0
        v = torch.where(m, values.to(compute_dtype(values)), 0.0)
        n = m.sum().to(v.dtype)
        mean = v.sum() / n.clamp(min=1)
        dev = torch.where(m, v - mean, 0.0)
        var = (dev * dev).sum() / (n - 1).clamp(min=1)
        return torch.where(m, dev * torch.rsqrt(var + eps), 0.0)
