"""Teacher map and temperature calibration (docs/algorithm.md §4, §6a, §6d, §10).

    tau = (K - 1) / (rho * sqrt(K))                    per tree, K = its actual leaf count, 0 < rho < 1/2
    q_i = 1/2 + V_i / tau                               "odds" teacher (default)
    r*_i = q_i / (1 - q_i) = (tau + 2 V_i) / (tau - 2 V_i)

With ddof = 1 standardization |V_i| <= (K-1)/sqrt(K) (Samuelson; backup is a convex combination), hence
|V_i|/tau <= rho, q_i in [1/2 - rho, 1/2 + rho] and r*_i in [(1-2rho)/(1+2rho), (1+2rho)/(1-2rho)].
q is affine in V, so it commutes with any normalized backup: q_parent = sum_c w_c q_c.

Ablation ("logistic" teacher): q_i = sigmoid(V_i / tau'), tau' = tau/4 (same slope at V = 0),
r*_i = exp(V_i/tau'). It does not commute with the backup.

No-signal trees (§10): K < 2 -> tau is None; K < 2 or zero reward variance -> V = 0, q = 1/2, r* = 1.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

TeacherName = Literal["odds", "logistic"]
TauMode = Literal["per_tree", "global"]


def check_rho(rho: float) -> float:
    r = float(rho)
    if not (math.isfinite(r) and 0.0 < r < 0.5):
        raise ValueError(f"rho must lie in the open interval (0, 1/2), got rho={rho}")
    return r


def calibrate_tau(num_leaves: int, rho: float) -> float:
    """tau = (K-1)/(rho sqrt(K)) for a tree with K = num_leaves >= 2 leaves (the tight, per-tree choice)."""
    r = check_rho(rho)
    k = int(num_leaves)
    if k != num_leaves or k < 2:
        raise ValueError(
            f"num_leaves must be an integer >= 2 (tau is undefined for K < 2), got {num_leaves!r}"
        )
    return (k - 1) / (r * math.sqrt(k))


def global_tau(k_max: int, rho: float) -> float:
    """One tau for every tree, from the nominal leaf count k_max = M(1+N).

    (K-1)/sqrt(K) increases with K, so this tau is at least the per-tree tau of any tree with K <= k_max:
    the bound still holds (conservatively, q stays nearer 1/2) for trees that lost branches.
    """
    return calibrate_tau(k_max, rho)


def _check_tau(tau: float) -> float:
    t = float(tau)
    if not (math.isfinite(t) and t > 0.0):
        raise ValueError(f"tau must be a finite positive number or None, got {tau!r}")
    return t


def teacher_targets(v: npt.ArrayLike, tau: float | None) -> tuple[FloatArray, FloatArray]:
    """Odds teacher: (q, r*) = (1/2 + V/tau, (tau + 2V)/(tau - 2V)); tau None -> (1/2, 1).

    Raises ValueError if some q falls outside (0, 1): the calibration bound was broken (e.g. rewards
    standardized with ddof = 0, or a tau computed for fewer leaves than the tree has).
    """
    val = np.asarray(v, dtype=np.float64)
    if tau is None:
        return np.full(val.shape, 0.5), np.ones(val.shape)
    t = _check_tau(tau)
    q = 0.5 + val / t
    bad = np.flatnonzero(~((q > 0.0) & (q < 1.0)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"teacher q[{i}] = {float(q.flat[i])} is outside (0, 1) (V = {float(val.flat[i])}, tau = {t}): "
            "|V|/tau must stay below 1/2; was z standardized with ddof=0 or tau computed for a smaller K?"
        )
    r_star = (t + 2.0 * val) / (t - 2.0 * val)
    return q, r_star


def logistic_teacher(v: npt.ArrayLike, tau: float | None) -> tuple[FloatArray, FloatArray]:
    """Ablation teacher: q = sigmoid(V/tau'), r* = exp(V/tau') with tau' = tau/4; tau None -> (1/2, 1)."""
    val = np.asarray(v, dtype=np.float64)
    if tau is None:
        return np.full(val.shape, 0.5), np.ones(val.shape)
    x = val / (_check_tau(tau) / 4.0)
    # sigmoid via exp(-|x|), which never overflows
    e = np.exp(-np.abs(x))
    q = np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    with np.errstate(over="ignore"):  # r* = inf only for absurd |V|/tau' > 709; bounded V gives |x| < 2
        return q, np.exp(x)


def teacher_tau(k: int, rho: float, tau_mode: str, k_nominal: int | None) -> float | None:
    """Per-tree or global tau; options are validated even when K < 2 so config errors surface early."""
    if tau_mode not in ("per_tree", "global"):
        raise ValueError(f"tau_mode must be 'per_tree' or 'global', got {tau_mode!r}")
    if tau_mode == "global":
        if k_nominal is None:
            raise ValueError("tau_mode='global' needs k_nominal (the nominal leaf count M(1+N))")
        if k > k_nominal:
            # (K-1)/sqrt(K) grows with K: a tau from a smaller nominal K would break the bound.
            raise ValueError(
                f"tree has K={k} leaves, more than k_nominal={k_nominal}; the global tau is unsafe"
            )
        tau = global_tau(k_nominal, rho)  # validates k_nominal even when this tree has K < 2
        return None if k < 2 else tau
    return None if k < 2 else calibrate_tau(k, rho)


def student_kl(q: npt.ArrayLike, s: npt.ArrayLike) -> FloatArray:
    """KL(Bern(q) ‖ Bern(σ(s))) per turn, the summand of the TreeOPSD loss (docs/algorithm.md §5), in numpy:
    q log q + (1−q) log(1−q) − q logσ(s) − (1−q) logσ(−s), with 0·log 0 = 0 and logσ(x) = −log(1 + e^−x)
    written to stay finite for large |s|; learner/losses.py computes the same in torch."""
    qa = np.asarray(q, dtype=np.float64)
    sa = np.asarray(s, dtype=np.float64)

    def xlogx(x: FloatArray) -> FloatArray:
        return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)

    def logsigmoid(x: FloatArray) -> FloatArray:
        return -np.logaddexp(0.0, -x)

    kl: FloatArray = xlogx(qa) + xlogx(1 - qa) - qa * logsigmoid(sa) - (1 - qa) * logsigmoid(-sa)
    return np.maximum(kl, 0.0)
