"""TreeOPSD loss: per-turn forward KL(Q*||P) to the tree teacher (docs/algorithm.md §5, §6, §10).

Pure torch. Every function takes flat per-token tensors and returns ``(loss, stats)``; ``stats`` holds
detached python floats. Nothing here logs, reads files or touches the network.

Shapes (T = tokens in the micro-batch, n = turns addressed by ``turn_ids``):

    logp           [T]  float  log π_θ(y_t | h_t) (carries the graph)
    behavior_logp  [T]  float  log μ(y_t | h_t) (treated as a constant)
    turn_ids       [T]  long   turn index in [0, n) of each token; -1 = not in the loss (prompt, o_i, padding)
    q              [n]  float  teacher q_i = 1/2 + V_i/τ (or logit(q_i) = log r*_i with ``teacher_logits``)

Per turn (§1, §5):

    ℓ_i  = number of finite loss tokens of turn i
    s_i  = (1/ℓ_i) Σ_t (logp_t − behavior_logp_t)
    KL_i = q log q + (1−q) log(1−q) − q logσ(s_i) − (1−q) logσ(−s_i)        (≥ 0, = 0 at s_i = logit q_i)
    L    = Σ_{i: ℓ_i>0} ℓ_i KL_i / Z,   Z = Σ_{i: ℓ_i>0} ℓ_i  (or ``z_total``)

dL/ds_i = ℓ_i (σ(s_i) − q_i) / Z, so ∇L = (1/Z) Σ_i (σ(s_i) − q_i) Σ_t ∇log π_θ(y_{i,t}): at θ = μ this is
−(1/Z) Σ_i (V_i/τ) ∇log π_θ(turn i), the tree policy gradient (§6b). ``treeopsd_advantages`` with
``pg_surrogate_loss`` gives the same gradient at every θ in policy-gradient form.

With the rollout correction's weights c_t (§11.1) the mean and the turn's weight become weighted:

    m_i = Σ_t c_t,   s_i = Σ_t c_t (logp_t − ref_t) / m_i,   L = Σ_{i: m_i>0} m_i KL_i / Z    (Z unchanged)

so dL/dlogp_t = c_t (σ(s_i) − q_i) / Z (each token's term importance-weighted) while the minimum stays at
s_i = log r*_i: a weighted mean of log-ratios, not a weighted sum that would stop at log r*_i / c̄_i.

The PPO-style baselines (GRPO, GSPO, TreePO) live in ``learner.baselines`` and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from learner.baselines import (
    compute_dtype,
    grpo_advantages,
    grpo_loss,
    gspo_loss,
    masked_whiten,
    ppo_clip_loss,
    treepo_advantages,
    treepo_loss,
)

__all__ = [
    "compute_dtype",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "masked_whiten",
    "pg_surrogate_loss",
    "ppo_clip_loss",
    "treeopsd_advantages",
    "treeopsd_loss",
    "treepo_advantages",
    "treepo_loss",
]


@dataclass
class _Turns:
    """Segment reduction of a token stream into turns. All tensors are [n] unless noted."""

    s: torch.Tensor  # c-weighted mean log-ratio s_i (0 where m_i = 0); carries the graph of logp
    ell: torch.Tensor  # ℓ_i: finite loss tokens per turn (compute dtype); what Z counts
    mass: torch.Tensor  # m_i = Σ_t c_t over them: the turn's weight in the loss (= ℓ_i without weights)
    active: torch.Tensor  # bool, m_i > 0
    token_turn: torch.Tensor  # [T] long, turn of each token clamped to >= 0 (use with token_ok)
    token_ok: torch.Tensor  # [T] bool, token is in the loss and finite
    nonfinite_tokens: int  # loss tokens (turn_id >= 0) dropped because logp or behavior_logp is not finite
    nonfinite_turns: int  # turns with at least one dropped token


def _segment_turns(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    turn_ids: torch.Tensor,
    n_turns: int,
    dtype: torch.dtype,
    token_w: torch.Tensor | None = None,
) -> _Turns:
    if logp.dim() != 1 or logp.shape != behavior_logp.shape or logp.shape != turn_ids.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, behavior_logp {tuple(behavior_logp.shape)} and turn_ids "
            f"{tuple(turn_ids.shape)} must all be the same 1-D shape [T]"
        )
    if turn_ids.is_floating_point():
        raise TypeError("turn_ids must be an integer tensor")
    in_loss = turn_ids >= 0
    if turn_ids.numel() and int(turn_ids.max()) >= n_turns:
        raise ValueError(f"turn_ids reach {int(turn_ids.max())} but q has only {n_turns} turns")
    lp = logp.to(dtype)
    blp = behavior_logp.detach().to(dtype)
    finite = torch.isfinite(lp) & torch.isfinite(blp)
    ok = in_loss & finite
    # torch.where (not multiplication) so that a NaN/inf token contributes neither value nor gradient.
    diff = torch.where(ok, lp, 0.0) - torch.where(ok, blp, 0.0)
    # rollout correction (learner/rollout_correction.py): weights normalised within the turn, so that s_i is
    # a weighted *mean* log-ratio and the loss's minimum stays at s_i = log r*_i (§11.1)
    c = (
        ok.to(dtype)
        if token_w is None
        else torch.where(ok, token_w.detach().to(device=lp.device, dtype=dtype), 0.0)
    )
    # Tokens outside the loss go to a spare slot n_turns, dropped after the segment sums.
    slot = torch.where(in_loss, turn_ids, n_turns).long()
    zeros = torch.zeros(n_turns + 1, dtype=dtype, device=logp.device)
    ell = zeros.index_add(0, slot, ok.to(dtype))[:n_turns]
    mass = zeros.index_add(0, slot, c)[:n_turns]
    s = zeros.index_add(0, slot, c * diff)[:n_turns] / torch.where(mass > 0, mass, 1.0)
    bad = in_loss & ~finite
    bad_per_turn = zeros.index_add(0, slot, bad.to(dtype))[:n_turns]
    idx = turn_ids.clamp(min=0).long()
    return _Turns(
        s=s,
        ell=ell,
        mass=mass,
        active=mass > 0,
        token_turn=idx,
        token_ok=ok & (c > 0),
        nonfinite_tokens=int(bad.sum()),
        nonfinite_turns=int((bad_per_turn > 0).sum()),
    )


def _teacher(q: torch.Tensor, dtype: torch.dtype, teacher_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (q, s*) with s* = logit(q) = log r*; q is detached."""
    q = q.detach().to(dtype)
    if teacher_logits:
        return torch.sigmoid(q), q
    return q, torch.log(q) - torch.log1p(-q)


def _kl(q: torch.Tensor, s: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """KL(Bern(q) || Bern(σ(s))) elementwise; ``u`` = logit(q) when the teacher came as logits.

    Written as q (log q − logσ(s)) + (1−q)(log(1−q) − logσ(−s)) so that each bracket cancels exactly at the
    target; xlogy makes q ∈ {0, 1} exact (0·log 0 = 0), logsigmoid keeps large |s| finite.
    """
    if u is not None:
        return q * (F.logsigmoid(u) - F.logsigmoid(s)) + (1 - q) * (F.logsigmoid(-u) - F.logsigmoid(-s))
    return (torch.xlogy(q, q) - q * F.logsigmoid(s)) + (
        torch.xlogy(1 - q, 1 - q) - (1 - q) * F.logsigmoid(-s)
    )


def treeopsd_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    turn_ids: torch.Tensor,
    q: torch.Tensor,
    *,
    teacher_logits: bool = False,
    z_total: float | torch.Tensor | None = None,
    turn_weights: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """TreeOPSD loss L = Σ_i ℓ_i KL(q_i || σ(s_i)) / Z over the turns with ℓ_i > 0 (docs/algorithm.md §5).

    Args:
        logp: [T] student log-probs of the sampled tokens (gradients flow through this only).
        behavior_logp: [T] behavior log-probs log μ; detached.
        turn_ids: [T] long; turn index of each token in [0, n), or -1 for tokens outside the loss.
        q: [n] teacher probabilities q_i ∈ [0, 1]; detached. With ``teacher_logits=True``, ``q`` holds
            logit(q_i) = log r*_i instead (any real), and KL is evaluated from logsigmoid of it.
        z_total: normalizer override Z (e.g. the global loss-token count over micro-batches and DP ranks);
            default Σ ℓ_i of this call (Σ w_i ℓ_i with turn weights; token weights do not enter Z, so a
            masked token shrinks the step). Must be > 0 when this call has loss tokens.
        turn_weights: [n] w_i ≥ 0 multiplying each turn's weight in the sum and its ℓ_i in Z (the depth
            correction, docs/algorithm.md §5.3); None: w ≡ 1.
        token_weights: [T] importance weights c_t ≥ 0 of the rollout correction (§11.1): s_i a c-weighted
            mean, the turn weighing m_i = Σ_t c_t (module docstring; m_i = 0 leaves the sum, not Z).

    Computed in float32, or float64 if any input is float64. Behavior (§10):
      * loss tokens whose logp or behavior_logp is NaN/±inf are dropped from s_i and ℓ_i and counted;
        a turn left with no finite tokens has ℓ_i = 0;
      * turns with ℓ_i = 0 are excluded from the loss and from Z (their q is never read);
      * with no loss token at all the loss is a zero that still carries a grad_fn reaching ``logp``, so
        ``loss.backward()`` works and yields zero gradients;
      * the value is clamped at 0 against rounding (straight-through: the gradient stays exact).

    Returns ``(loss, stats)``; stats (python floats, over turns with ℓ_i > 0 of this call):
        mean_abs_s, max_abs_s: turn-mean and max of |s_i|;
        kl_to_target: weighted mean KL, Σ w_i m_i KL_i / Σ w_i m_i (ignores ``z_total``);
        overshoot_frac: fraction of turns that passed their target. The residual σ(s)−q has at the behavior
            policy (s = 0) the value 1/2 − q; a turn is overshot iff its current residual has the strictly
            opposite sign, i.e. s* = logit(q) lies strictly between 0 and s. A turn with q = 1/2 exactly
            (s* = 0) counts as overshot iff s ≠ 0; a turn exactly at its target is not overshot;
        num_turns, num_tokens (Σ ℓ_i), weight_mass (Σ m_i: the tokens' total correction weight),
        nonfinite_tokens, nonfinite_turns (turns with a dropped token).
    """
    dtype = compute_dtype(logp, behavior_logp, q)
    if q.dim() != 1:
        raise ValueError(f"q must be 1-D [n_turns], got {tuple(q.shape)}")
    turns = _segment_turns(logp, behavior_logp, turn_ids, q.shape[0], dtype, token_weights)
    act = turns.active
    q_p, s_star = _active_teacher(q, act, dtype, teacher_logits)
    kl = _kl(q_p, turns.s, s_star if teacher_logits else None)
    kl = kl + (kl.clamp(min=0.0) - kl).detach()
    w = None if turn_weights is None else turn_weights.to(dtype=dtype, device=logp.device)
    mass = turns.mass if w is None else turns.mass * w
    weighted = torch.where(act, mass * kl, 0.0).sum()
    z = _normalizer(turns.ell if w is None else turns.ell * w, z_total, dtype, logp.device)
    loss = weighted / torch.where(z > 0, z, torch.ones_like(z))
    kl_mean = float(weighted.detach()) / max(float(mass.sum()), 1e-300)
    return loss, _turn_stats(turns, s_star, kl_mean, dtype)


def _active_teacher(
    q: torch.Tensor, act: torch.Tensor, dtype: torch.dtype, teacher_logits: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s*) on the turns with loss tokens, checked; inactive turns read a neutral teacher, so that an
    unused NaN or out-of-range q cannot leak in."""
    q_p, s_star = _teacher(q, dtype, teacher_logits)
    q_p, s_star = torch.where(act, q_p, 0.5), torch.where(act, s_star, 0.0)
    if teacher_logits:
        if not bool(torch.isfinite(s_star).all()):
            raise ValueError("teacher logits must be finite for every turn with loss tokens")
    elif bool(((q_p < 0) | (q_p > 1) | torch.isnan(q_p)).any()):
        raise ValueError("q must lie in [0, 1] for every turn with loss tokens")
    return q_p, s_star


def _normalizer(
    ell: torch.Tensor, z_total: float | torch.Tensor | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Z: Σ ℓ_i of this call, or the caller's global count (micro-batches, ranks)."""
    if z_total is None:
        return ell.sum()
    z = torch.as_tensor(z_total, dtype=dtype, device=device)
    if float(ell.sum()) > 0 and not float(z) > 0:
        raise ValueError(f"z_total must be > 0 when there are loss tokens, got {float(z)}")
    return z


@torch.no_grad()
def _turn_stats(turns: _Turns, s_star: torch.Tensor, kl_mean: float, dtype: torch.dtype) -> dict[str, float]:
    act = turns.active
    n_act, num_tokens = int(act.sum()), float(turns.ell[act].sum())
    s_a, s_star_a = turns.s[act], s_star[act]
    abs_s = s_a.abs()
    away = (s_a - s_star_a) * (0.0 - s_star_a) < 0
    overshot = torch.where(s_star_a == 0, s_a != 0, away)
    return {
        "mean_abs_s": float(abs_s.mean()) if n_act else 0.0,
        "max_abs_s": float(abs_s.max()) if n_act else 0.0,
        "kl_to_target": kl_mean if num_tokens > 0 else 0.0,
        "overshoot_frac": float(overshot.to(dtype).mean()) if n_act else 0.0,
        "num_turns": float(n_act),
        "num_tokens": num_tokens,
        "weight_mass": float(turns.mass.sum()),
        "nonfinite_tokens": float(turns.nonfinite_tokens),
        "nonfinite_turns": float(turns.nonfinite_turns),
    }


def treeopsd_advantages(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    turn_ids: torch.Tensor,
    q: torch.Tensor,
    *,
    teacher_logits: bool = False,
) -> torch.Tensor:
    """Per-token advantage Â_t = q_i − σ(s_i) for token t of turn i (§5 "equivalent form"), detached; without
    the rollout correction (the weighted form is Â_t = c_t (q_i − σ(s_i)) with the weighted s_i).

    Shapes as ``treeopsd_loss``; returns [T] in the compute dtype. Tokens outside the loss (turn_id −1) and
    dropped non-finite tokens get 0. With ``pg_surrogate_loss`` and the same Z the gradient equals
    ``treeopsd_loss``'s at every θ; recompute it for the current θ in every mini-batch.
    """
    with torch.no_grad():
        dtype = compute_dtype(logp, behavior_logp, q)
        turns = _segment_turns(logp.detach(), behavior_logp, turn_ids, q.shape[0], dtype)
        q_p, _ = _teacher(q, dtype, teacher_logits)
        adv_turn = torch.where(turns.active, q_p - torch.sigmoid(turns.s), 0.0)
        return torch.where(turns.token_ok, adv_turn[turns.token_turn], 0.0)


def pg_surrogate_loss(
    logp: torch.Tensor,
    turn_ids_or_mask: torch.Tensor,
    advantages_per_token: torch.Tensor,
    z: float | torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient surrogate L_pg = −(1/Z) Σ_t Â_t log π_θ(y_t) over loss tokens (§5).

    Args:
        logp: [T] student log-probs.
        turn_ids_or_mask: [T] bool/float mask (nonzero = in the loss) or long turn ids (>= 0 = in the loss).
        advantages_per_token: [T] advantages, treated as constants (detached).
        z: normalizer Z (> 0), e.g. ``stats["num_tokens"]`` of ``treeopsd_loss`` or a global count.
    Non-finite logp tokens are skipped (they carry Â = 0 from ``treeopsd_advantages``).
    Returns ``(loss, {"num_tokens", "adv_mean"})`` (adv_mean: mean Â over counted tokens).
    """
    m = turn_ids_or_mask
    mask = m >= 0 if not (m.dtype == torch.bool or m.is_floating_point()) else m != 0
    dtype = compute_dtype(logp, advantages_per_token)
    lp = logp.to(dtype)
    ok = mask & torch.isfinite(lp)
    adv = advantages_per_token.detach().to(dtype)
    total = torch.where(ok, adv * torch.where(ok, lp, 0.0), 0.0).sum()
    z_t = torch.as_tensor(z, dtype=dtype, device=logp.device)
    loss = -total / torch.where(z_t > 0, z_t, torch.ones_like(z_t))
    n = int(ok.sum())
    stats = {"num_tokens": float(n), "adv_mean": float(adv[ok].mean()) if n else 0.0}
    return loss, stats
