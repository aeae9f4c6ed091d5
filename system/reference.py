"""Slow reference for the credit core, written in the paper's notation (docs/algorithm.md §3-§4).

Used only by tests to check ``system.credit`` / ``system.teacher``. Plain Python floats, explicit formulas,
recursion on a dict of children C(i); nothing is shared with the fast code:

    z_j = (R_j - R_bar) / (sd_1 + eps),   sd_1 = sqrt(sum_j (R_j - R_bar)^2 / (K - 1))
    V_leaf = z_leaf,   V_i = sum_{c in C(i)} w_ic V_c,   w_ic = u_c / sum_{c'} u_c'
    q_i = 1/2 + V_i / tau,   tau = (K - 1) / (rho sqrt(K))

The likelihood weights are written as w_ic = 1 / sum_{c'} exp(log u_c' - log u_c), which is the same ratio and
needs no shift to stay finite. Recursion depth equals tree depth, so keep reference trees shallow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

PROMPT = -1  # the prompt x: the root of the tree, not a turn


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """C(i) for every node and for the prompt (key -1), children in increasing node index."""
    kids: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    kids[PROMPT] = []
    for i, p in enumerate(parents):
        kids[int(p)].append(i)
    return kids


def ref_standardize(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """z_j by the textbook formula; zeros when K < 2 or sd_1 < 1e-12."""
    k = len(rewards)
    if k < 2:
        return [0.0] * k
    mean = sum(rewards) / k
    sd1 = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (k - 1))
    if sd1 < 1e-12:
        return [0.0] * k
    return [(r - mean) / (sd1 + eps) for r in rewards]


def _log_u(
    c: int, weights: str, kids: dict[int, list[int]], lp: Sequence[float], ln: Sequence[float]
) -> float:
    """log of the unnormalized weight u_c of child c."""
    if weights == "uniform":
        return 0.0
    if weights == "seq_likelihood":
        return float(lp[c])  # log mu(turn c)
    if weights == "geo_likelihood":
        return float(lp[c]) / float(ln[c]) if ln[c] > 0 else 0.0  # ell_c = 0 -> u_c = 1
    if weights == "leaf_count":
        return math.log(_num_leaves(c, kids))
    raise ValueError(weights)


def _num_leaves(i: int, kids: dict[int, list[int]]) -> int:
    return 1 if not kids[i] else sum(_num_leaves(c, kids) for c in kids[i])


def ref_weights(
    i: int,
    kids: dict[int, list[int]],
    weights: str,
    lp: Sequence[float] = (),
    ln: Sequence[float] = (),
) -> dict[int, float]:
    """w_ic for every child c of node i (i = -1: the prompt)."""
    logu = {c: _log_u(c, weights, kids, lp, ln) for c in kids[i]}
    return {c: 1.0 / sum(_exp(logu[d] - logu[c]) for d in kids[i]) for c in kids[i]}


def _exp(x: float) -> float:
    return math.exp(x) if x < 709.0 else math.inf  # math.exp raises instead of returning inf


def ref_value(
    i: int,
    kids: dict[int, list[int]],
    z: dict[int, float],
    weights: str,
    lp: Sequence[float] = (),
    ln: Sequence[float] = (),
) -> float:
    """V_i by recursion: z_i at a leaf, else the w-weighted mean of the children's V."""
    if i != PROMPT and not kids[i]:
        return z[i]
    w = ref_weights(i, kids, weights, lp, ln)
    return sum(w[c] * ref_value(c, kids, z, weights, lp, ln) for c in kids[i])


def ref_backup(
    parents: Sequence[int],
    leaf_values: Sequence[float],
    weights: str = "uniform",
    turn_logprob_sums: Sequence[float] = (),
    turn_lengths: Sequence[float] = (),
    credit: str = "pointwise",
) -> list[float]:
    """V_i for every node (listwise: V_i - V_parent(i), with V_prompt the backup over the first turns)."""
    kids = children_of(parents)
    z = {i: float(v) for i, v in enumerate(leaf_values) if not kids[i]}
    args = (kids, z, weights, turn_logprob_sums, turn_lengths)
    v = [ref_value(i, *args) for i in range(len(parents))]
    if credit == "pointwise":
        return v
    v_prompt = ref_value(PROMPT, *args)
    return [v[i] - (v_prompt if p == PROMPT else v[p]) for i, p in enumerate(parents)]


def ref_tau(k: int, rho: float) -> float:
    return (k - 1) / (rho * math.sqrt(k))


def ref_odds_teacher(v: float, tau: float) -> tuple[float, float]:
    """(q, r*) = (1/2 + V/tau, q/(1-q))."""
    q = 0.5 + v / tau
    return q, q / (1.0 - q)
