"""How well a per-turn credit signal separates progress turns from the rest: AUC and a paired bootstrap.

    auc(scores, labels)                                   # Mann–Whitney AUC, ties counted half
    m = pair_matrix(scores, labels, groups, n_groups)     # the same AUC split into tree-by-tree pair counts
    out = paired_bootstrap({"a": sa, "b": sb}, labels, groups, strata, n_boot=2000, seed=0,
                           diffs=[("a", "b")])            # 95% intervals over trees, paired across methods

AUC (Mann–Whitney form). With P positives (label True) and N negatives,

    AUC = (1 / (P·N)) Σ_{p ∈ pos} Σ_{n ∈ neg} ( [s_p > s_n] + ½ [s_p = s_n] )

the probability that a random positive outranks a random negative, a tie counting half; NaN when P = 0 or
N = 0 (no pair to compare). It depends only on the order of the scores, so any increasing map of a signal
(e.g. V ↦ q − ½ = V/τ within one tree) has the same AUC — across trees it need not, since τ varies.

Paired bootstrap over trees. Turns of one tree share a reward draw, so they are not independent; the unit
that is resampled is the tree (a cluster bootstrap). A replicate draws, within each stratum (a sampling
setting), as many trees with replacement as the stratum holds, giving every tree a multiplicity c_t. The
replicate's AUC is the AUC of the data with each tree's turns repeated c_t times, which decomposes exactly:

    U_ab = Σ_{p ∈ pos(a)} Σ_{n ∈ neg(b)} ( [s_p > s_n] + ½ [s_p = s_n] )     (pair counts, trees a, b)
    AUC(c) = cᵀ U c / ((c · P)(c · N)),       P_a, N_a = positives and negatives of tree a

so U is computed once per method and a replicate costs one matrix-vector product. The within-tree AUC
keeps only the diagonal, the pairs a learner actually contrasts (one tree's turns against each other):
Σ_a c_a U_aa / Σ_a c_a P_a N_a, a tree without both kinds of turn contributing nothing. Every method is scored
on the *same* multiplicities in a replicate, which is what makes a difference of two AUCs paired. The
interval is the 2.5 and 97.5 percentiles of the replicates (replicates with no pair are left out). Seeded:
the same inputs and seed give the same numbers. numpy only (system/ may import only configs and system).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def _inputs(scores: npt.ArrayLike, labels: npt.ArrayLike) -> tuple[FloatArray, BoolArray]:
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=bool).reshape(-1)
    if s.shape != y.shape:
        raise ValueError(f"scores {s.shape} and labels {y.shape} must have the same length")
    bad = np.flatnonzero(~np.isfinite(s))
    if bad.size:
        raise ValueError(f"score at index {int(bad[0])} is not finite ({float(s[bad[0]])})")
    return s, y


def _pairs_below(sorted_neg: FloatArray, pos: FloatArray) -> FloatArray:
    """For each positive score: negatives strictly below it, plus half of those equal to it."""
    lo = np.searchsorted(sorted_neg, pos, side="left")
    hi = np.searchsorted(sorted_neg, pos, side="right")
    out: FloatArray = lo + 0.5 * (hi - lo)
    return out


def auc(scores: npt.ArrayLike, labels: npt.ArrayLike) -> float:
    """Mann–Whitney AUC of `scores` for the True `labels`, ties counted half; NaN without a pos/neg pair."""
    s, y = _inputs(scores, labels)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    u = float(_pairs_below(np.sort(s[~y]), s[y]).sum())
    return u / (n_pos * n_neg)


@dataclass(frozen=True, eq=False)
class PairMatrix:
    """u[a, b]: pair counts between the positives of tree a and the negatives of tree b (module doc);
    pos[a], neg[a]: positives and negatives of tree a."""

    u: FloatArray
    pos: FloatArray
    neg: FloatArray

    def auc(self, counts: npt.ArrayLike | None = None) -> FloatArray:
        """AUC for each row of `counts` ([B, trees] multiplicities; None = every tree once), NaN where a
        row has no positive or no negative."""
        c = np.ones((1, self.pos.size)) if counts is None else np.atleast_2d(np.asarray(counts, float))
        num = ((c @ self.u) * c).sum(axis=1)
        den = (c @ self.pos) * (c @ self.neg)
        out: FloatArray = np.divide(num, den, out=np.full(num.shape, np.nan), where=den > 0)
        return out

    def within_auc(self, counts: npt.ArrayLike | None = None) -> FloatArray:
        """The within-tree AUC: only pairs of a positive and a negative of the same tree, each resampled
        copy of a tree its own tree: Σ_a c_a U_aa / Σ_a c_a P_a N_a (NaN where no tree has both)."""
        c = np.ones((1, self.pos.size)) if counts is None else np.atleast_2d(np.asarray(counts, float))
        num = c @ np.diag(self.u)
        den = c @ (self.pos * self.neg)
        out: FloatArray = np.divide(num, den, out=np.full(num.shape, np.nan), where=den > 0)
        return out


def pair_matrix(
    scores: npt.ArrayLike, labels: npt.ArrayLike, groups: npt.ArrayLike, n_groups: int
) -> PairMatrix:
    """The tree-by-tree decomposition of the AUC; `groups[i]` in [0, n_groups) is turn i's tree."""
    s, y = _inputs(scores, labels)
    g = np.asarray(groups, dtype=np.int64).reshape(-1)
    if g.shape != s.shape:
        raise ValueError(f"groups {g.shape} must have one entry per score {s.shape}")
    if g.size and (g.min() < 0 or g.max() >= n_groups):
        raise ValueError(f"groups must lie in [0, {n_groups})")
    pos_s, pos_g = s[y], g[y]
    neg_s, neg_g = s[~y], g[~y]
    order = np.lexsort((neg_s, neg_g))  # negatives by tree, then by score: one sorted slice per tree
    neg_s, neg_g = neg_s[order], neg_g[order]
    bounds = np.searchsorted(neg_g, np.arange(n_groups + 1))
    u = np.zeros((n_groups, n_groups))
    for b in range(n_groups):
        lo, hi = bounds[b], bounds[b + 1]
        if hi > lo and pos_s.size:
            below = _pairs_below(neg_s[lo:hi], pos_s)
            u[:, b] = np.bincount(pos_g, weights=below, minlength=n_groups)
    pos = np.bincount(pos_g, minlength=n_groups).astype(np.float64)
    neg = np.bincount(neg_g, minlength=n_groups).astype(np.float64)
    return PairMatrix(u, pos, neg)


def bootstrap_counts(strata: npt.ArrayLike, n_boot: int, seed: int) -> FloatArray:
    """[n_boot, trees] multiplicities: each stratum's trees drawn with replacement, its size kept."""
    st = np.asarray(strata).reshape(-1)
    rng = np.random.default_rng(seed)
    counts = np.zeros((n_boot, st.size))
    for value in sorted(set(st.tolist())):  # sorted: the draw order, hence the numbers, is fixed
        members = np.flatnonzero(st == value)
        picks = members[rng.integers(members.size, size=(n_boot, members.size))]
        np.add.at(counts, (np.arange(n_boot)[:, None], picks), 1.0)  # a repeated tree counts each time
    return counts


def _interval(values: FloatArray) -> tuple[float | None, float | None]:
    ok = values[np.isfinite(values)]
    if ok.size == 0:
        return None, None
    lo, hi = np.percentile(ok, [2.5, 97.5])
    return float(lo), float(hi)


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def paired_bootstrap(
    scores: Mapping[str, npt.ArrayLike],
    labels: npt.ArrayLike,
    groups: npt.ArrayLike,
    strata: npt.ArrayLike | None = None,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    diffs: Sequence[tuple[str, str]] = (),
    within: bool = False,
) -> dict[str, float | None]:
    """AUC of each signal with its 95% interval, and paired differences, over the same tree resamples.

    Args:
        scores: method name -> per-turn signal, all aligned with `labels`.
        labels: per-turn progress label. groups: per-turn tree index in [0, n_trees).
        strata: per-tree stratum (e.g. the sampling setting); None = one stratum.
        diffs: (a, b) pairs; reports AUC_a − AUC_b as "a_minus_b" with its interval.
        within: also the within-tree AUC of each signal (and difference), as "<name>_within".
    Returns {name, name_lo, name_hi, ...}; None where a value is undefined (no positive or no negative).
    """
    g = np.asarray(groups, dtype=np.int64).reshape(-1)
    n_trees = int(g.max()) + 1 if g.size else 0
    st = np.zeros(n_trees) if strata is None else np.asarray(strata).reshape(-1)
    if st.size != n_trees:
        raise ValueError(f"strata needs one entry per tree ({n_trees}), got {st.size}")
    counts = bootstrap_counts(st, n_boot, seed)
    point: dict[str, float] = {}
    reps: dict[str, FloatArray] = {}
    for name, s in scores.items():
        m = pair_matrix(s, labels, g, n_trees)
        point[name], reps[name] = float(m.auc()[0]), m.auc(counts)
        if within:
            point[f"{name}_within"], reps[f"{name}_within"] = float(m.within_auc()[0]), m.within_auc(counts)
    for a, b in diffs:
        for tail in ("", "_within") if within else ("",):
            key = f"{a}_minus_{b}{tail}"
            point[key], reps[key] = point[a + tail] - point[b + tail], reps[a + tail] - reps[b + tail]
    out: dict[str, float | None] = {}
    for name, value in point.items():
        out[name] = _finite(value)
        out[f"{name}_lo"], out[f"{name}_hi"] = _interval(reps[name])
    return out
