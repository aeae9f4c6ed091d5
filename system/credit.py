"""The credit backup (docs/algorithm.md §3–§4): a raw RolloutTree in, the same tree with z, V, τ, q out.

    credited = credit_rollout_tree(tree, cfg.algo)    # what the backup role runs on every raw tree
    c = credit_tree(parents, rewards, rho=0.1)         # the same on plain arrays: R -> z -> V -> tau -> q

A tree is a *parent array* (system/parents.py): ``parents[i]`` is the index of turn i's parent turn, or -1
for a first turn. Leaves are the nodes without children; they carry the K rewards. `credit_rollout_tree`
maps node ids to turn indices (node i ↔ turn i−1; the root is not a turn and gets NaN); the teacher map and
τ live in system/teacher.py.

Formulas (float64 throughout):

    z_j = (R_j - mean(R)) / (sd_1(R) + 1e-6)      sd_1 = sample std (ddof = 1); z = 0 if K < 2 or sd_1 < 1e-12
    V_leaf = z_leaf
    V_i = sum_{c in C(i)} w_ic V_c                 w_ic >= 0, sum_c w_ic = 1 (post-order)

Backup weights, w_ic proportional to (normalized over the siblings, in log space with a max shift):

    uniform         1
    geo_likelihood  exp(logprob_sum_c / len_c); a child with len_c = 0 (no model tokens) gets exp(0) = 1,
                    i.e. it is treated like a turn whose tokens all had probability one
    seq_likelihood  exp(logprob_sum_c) = mu(turn c); never under/overflows thanks to the shift
    leaf_count      number of leaves under c (so V_i = mean of the leaf z under i)

``credit="pointwise"`` (default) returns V. ``credit="listwise"`` is the ablation and returns the advantage
A_i = V_i - V_parent(i); for a first turn the parent is the prompt, whose value V_root = sum_c w_root,c V_c is
the backup over the first turns with the same weights. Note sum_c w_ic A_c = 0 for every internal node.

Everything is vectorized: depths come from pointer doubling (which also finds cycles), and the backup runs
one numpy step per depth level, deepest first, so the cost is O(n log n + depth) numpy work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from configs.algo import AlgoConfig
from system.parents import (
    BoolArray,
    IntArray,
    as_parents,
    depths_checked,
    leaf_mask,
    levels_deepest_first,
)
from system.teacher import TauMode, TeacherName, check_rho, logistic_teacher, teacher_targets, teacher_tau
from system.tree import NodeCredit, RolloutTree

WeightName = Literal["uniform", "geo_likelihood", "seq_likelihood", "leaf_count"]
CreditName = Literal["pointwise", "listwise"]
WEIGHT_OPTIONS: tuple[str, ...] = ("uniform", "geo_likelihood", "seq_likelihood", "leaf_count")
CREDIT_OPTIONS: tuple[str, ...] = ("pointwise", "listwise")

STD_EPS = 1e-6  # the epsilon in the z denominator (§3.1)
ZERO_STD = 1e-12  # below this sample std the tree counts as zero-variance (§10)

FloatArray = npt.NDArray[np.float64]


def standardize_rewards(rewards: npt.ArrayLike) -> FloatArray:
    """z_j = (R_j - mean) / (sd_ddof1 + 1e-6); all zeros when K < 2 or sd_ddof1 < 1e-12.

    ddof = 1 is what makes |z| <= (K-1)/sqrt(K) and hence the teacher bound hold (docs/algorithm.md §6a).
    Raises ValueError naming the first index whose reward is NaN or infinite.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {r.shape}")
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        raise ValueError(f"reward at index {int(bad[0])} is not finite ({float(r[bad[0]])})")
    if r.size < 2:
        return np.zeros_like(r)
    sd = float(np.std(r, ddof=1))
    if sd < ZERO_STD:
        return np.zeros_like(r)
    z: FloatArray = (r - r.mean()) / (sd + STD_EPS)
    return z


def _accumulate(slot: IntArray, levels: list[IntArray], init: FloatArray, w: FloatArray) -> FloatArray:
    """Bottom-up pass: out[slot[i]] += w[i] * out[i], level by level, deepest first.

    ``slot`` is the parent with the prompt mapped to index n; ``init`` has length n+1. Children of a node
    are all one level deeper, so a node's total is complete before its own level is pushed up.
    """
    out = init.copy()
    for idx in levels:
        if idx.size == 1:  # chains: scalar path avoids ufunc.at overhead
            i = int(idx[0])
            out[slot[i]] += w[i] * out[i]
        else:
            np.add.at(out, slot[idx], w[idx] * out[idx])
    return out


def _check_leaf_values(leaf: BoolArray, values: FloatArray) -> None:
    bad_leaf = np.flatnonzero(leaf & ~np.isfinite(values))
    if bad_leaf.size:
        i = int(bad_leaf[0])
        raise ValueError(f"leaf node {i} needs a finite value, got {float(values[i])}")
    bad_inner = np.flatnonzero(~leaf & ~np.isnan(values))
    if bad_inner.size:
        i = int(bad_inner[0])
        raise ValueError(f"internal node {i} has value {float(values[i])}; internal nodes must be NaN")


def _per_node(name: str, arr: npt.ArrayLike | None, n: int, weights: str) -> FloatArray:
    if arr is None:
        raise ValueError(f"weights={weights!r} needs {name}")
    a = np.asarray(arr, dtype=np.float64)
    if a.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {a.shape}")
    bad = np.flatnonzero(~np.isfinite(a))
    if bad.size:
        raise ValueError(f"{name}[{int(bad[0])}] is not finite ({float(a[bad[0]])})")
    return a


def _log_weights(
    weights: str,
    n: int,
    leaf_counts: FloatArray | None,
    turn_logprob_sums: npt.ArrayLike | None,
    turn_lengths: npt.ArrayLike | None,
) -> FloatArray:
    """Unnormalized log w_c for every node c (its weight within its own parent)."""
    if weights == "uniform":
        return np.zeros(n)
    if weights == "leaf_count":
        assert leaf_counts is not None
        return np.log(leaf_counts)
    lp = _per_node("turn_logprob_sums", turn_logprob_sums, n, weights)
    if weights == "seq_likelihood":
        return lp
    lengths = _per_node("turn_lengths", turn_lengths, n, weights)
    if np.any(lengths < 0):
        raise ValueError(f"turn_lengths[{int(np.flatnonzero(lengths < 0)[0])}] is negative")
    # Zero-token turn: log w = 0 (weight 1, a per-token probability of one); it has no tokens to average.
    return np.divide(lp, lengths, out=np.zeros(n), where=lengths > 0)


def _normalize(slot: IntArray, logw: FloatArray, n: int) -> FloatArray:
    """Softmax of log w over each sibling group (grouped by ``slot``), with a per-group max shift."""
    gmax = np.full(n + 1, -np.inf)
    np.maximum.at(gmax, slot, logw)
    e = np.exp(logw - gmax[slot])  # the max child of each group gets exp(0) = 1, so sums are >= 1
    total = np.bincount(slot, weights=e, minlength=n + 1)
    w: FloatArray = e / total[slot]
    return w


def backup_weights(
    parents: npt.ArrayLike,
    weights: WeightName | str = "uniform",
    turn_logprob_sums: npt.ArrayLike | None = None,
    turn_lengths: npt.ArrayLike | None = None,
) -> FloatArray:
    """Normalized weight w_{parent(c), c} of every node c; the weights of each sibling group sum to 1.

    First turns are one sibling group (children of the prompt). Validates like ``backup_credit``.
    """
    p = as_parents(parents)
    return _weights_and_levels(p, depths_checked(p), weights, turn_logprob_sums, turn_lengths)[0]


def _weights_and_levels(
    p: IntArray,
    depth: IntArray,
    weights: str,
    turn_logprob_sums: npt.ArrayLike | None,
    turn_lengths: npt.ArrayLike | None,
) -> tuple[FloatArray, IntArray, list[IntArray]]:
    if weights not in WEIGHT_OPTIONS:
        raise ValueError(f"weights must be one of {WEIGHT_OPTIONS}, got {weights!r}")
    n = p.size
    levels = levels_deepest_first(depth)
    slot = np.where(p < 0, n, p)
    counts = None
    if weights == "leaf_count":
        leaf = np.ones(n + 1)
        leaf[np.unique(slot)] = 0.0  # internal nodes (and the prompt slot) start at zero
        counts = _accumulate(slot, levels, leaf, np.ones(n))[:n]
    logw = _log_weights(weights, n, counts, turn_logprob_sums, turn_lengths)
    return _normalize(slot, logw, n), slot, levels


def backup_credit(
    parents: npt.ArrayLike,
    leaf_values: npt.ArrayLike,
    weights: WeightName | str = "uniform",
    turn_logprob_sums: npt.ArrayLike | None = None,
    turn_lengths: npt.ArrayLike | None = None,
    credit: CreditName | str = "pointwise",
) -> FloatArray:
    """Backed-up credit for every node (module docstring has the formulas).

    Args:
        parents: (n,) parent turn of each node, -1 for a first turn; any node order.
        leaf_values: (n,) standardized reward z on leaves, NaN on internal nodes.
        weights: backup weight option (see module docstring).
        turn_logprob_sums: (n,) sum of behavior log-probs of each turn's model tokens (likelihood weights).
        turn_lengths: (n,) number of model tokens ell_i of each turn (geo_likelihood).
        credit: "pointwise" -> V_i; "listwise" (ablation) -> V_i - V_parent(i).

    Returns:
        (n,) float64 V (or A for listwise).

    Raises:
        ValueError: parents out of range or cyclic, leaf without a finite value, internal node with a value,
        unknown option, or missing/non-finite log-prob inputs.
    """
    if credit not in CREDIT_OPTIONS:
        raise ValueError(f"credit must be one of {CREDIT_OPTIONS}, got {credit!r}")
    p = as_parents(parents)
    n = p.size
    values = np.asarray(leaf_values, dtype=np.float64)
    if values.shape != (n,):
        raise ValueError(f"leaf_values must have shape ({n},) like parents, got {values.shape}")
    depth = depths_checked(p)  # cycle errors first: on a cycle the leaf/internal split is meaningless
    has_child = np.zeros(n, dtype=bool)
    has_child[p[p >= 0]] = True
    _check_leaf_values(~has_child, values)
    w, slot, levels = _weights_and_levels(p, depth, weights, turn_logprob_sums, turn_lengths)
    init = np.zeros(n + 1)
    init[:n][~has_child] = values[~has_child]
    v = _accumulate(slot, levels, init, w)
    if credit == "listwise":
        return v[:n] - v[slot]  # v[n] is the prompt's backed-up value
    return v[:n]


# ---- the whole backup of one tree (what the backup role runs) -------------------------------------------
@dataclass(frozen=True, eq=False)
class TreeCredit:
    """Per-node credit of one tree; arrays are (n,) float64 in the tree's node order.

    z: standardized reward on leaves, NaN on internal nodes.
    V: the credit fed to the teacher (pointwise V_i, or listwise V_i - V_parent(i)).
    tau: temperature, None when K < 2.
    q, r_star: teacher probability and target ratio.
    num_leaves: K.
    """

    z: FloatArray
    V: FloatArray
    tau: float | None
    q: FloatArray
    r_star: FloatArray
    num_leaves: int


def credit_tree(
    parents: npt.ArrayLike,
    rewards_on_leaves: npt.ArrayLike,
    rho: float,
    weights: WeightName | str = "uniform",
    teacher: TeacherName | str = "odds",
    tau_mode: TauMode | str = "per_tree",
    k_nominal: int | None = None,
    credit: CreditName | str = "pointwise",
    turn_logprob_sums: npt.ArrayLike | None = None,
    turn_lengths: npt.ArrayLike | None = None,
) -> TreeCredit:
    """The whole backup-actor computation for one tree: R -> z -> V -> tau -> (q, r*).

    ``rewards_on_leaves`` is (n,) like ``parents``: the raw reward R on each leaf, NaN on internal nodes.
    K < 2 or zero reward variance gives V = 0, q = 1/2, r* = 1 (tau is None only for K < 2).

    Listwise credit (ablation) is not covered by the rho bound: |V_i - V_parent(i)| <= max z - min z, which
    can approach sqrt(2K/(K-1)) rho tau, so q may leave (0, 1) once rho >= sqrt((K-1)/(8K)) (0.25 at K = 2,
    0.34 at K = 12); ``teacher_targets`` then raises. Use a small rho with listwise credit.
    """
    check_rho(rho)
    if teacher not in ("odds", "logistic"):
        raise ValueError(f"teacher must be 'odds' or 'logistic', got {teacher!r}")
    leaf = leaf_mask(parents)
    r = np.asarray(rewards_on_leaves, dtype=np.float64)
    if r.shape != leaf.shape:
        raise ValueError(f"rewards_on_leaves must have shape {leaf.shape} like parents, got {r.shape}")
    inner = np.flatnonzero(~leaf & ~np.isnan(r))
    if inner.size:
        i = int(inner[0])
        raise ValueError(f"internal node {i} has reward {float(r[i])}; internal nodes must be NaN")
    bad = np.flatnonzero(leaf & ~np.isfinite(r))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"leaf node {i} needs a finite reward, got {float(r[i])}")
    z = np.full(r.shape, np.nan)
    z[leaf] = standardize_rewards(r[leaf])
    k = int(leaf.sum())
    v = backup_credit(parents, z, weights, turn_logprob_sums, turn_lengths, credit)
    tau = teacher_tau(k, rho, tau_mode, k_nominal)
    q, r_star = teacher_targets(v, tau) if teacher == "odds" else logistic_teacher(v, tau)
    return TreeCredit(z=z, V=v, tau=tau, q=q, r_star=r_star, num_leaves=k)


def turn_logprob_stats(tree: RolloutTree) -> tuple[np.ndarray, np.ndarray]:
    """(Σ_t log μ(y_t), ℓ) per turn over finite loss tokens, turn-indexed."""
    sums, lengths = [], []
    for n in tree.nodes[1:]:
        m = tree.effective_mask(n.node_id)
        sums.append(float(n.behavior_logprobs[m].astype(np.float64).sum()))
        lengths.append(int(m.sum()))
    return np.array(sums), np.array(lengths, dtype=np.float64)


def credit_rollout_tree(tree: RolloutTree, algo: AlgoConfig) -> RolloutTree:
    """Attaches NodeCredit; idempotent (a tree that already has credit is recomputed identically)."""
    rewards = np.array([n.reward for n in tree.nodes[1:]], dtype=np.float64)
    sums, lengths = turn_logprob_stats(tree)
    c = credit_tree(
        tree.turn_parents(),
        rewards,
        algo.rho,
        weights=algo.backup_weights,
        teacher=algo.teacher,
        tau_mode=algo.tau_mode,
        k_nominal=algo.nominal_leaves if algo.tau_mode == "global" else None,
        credit=algo.credit,
        turn_logprob_sums=sums,
        turn_lengths=lengths,
    )

    def with_root(a: np.ndarray) -> np.ndarray:
        return np.concatenate([[np.nan], a])

    return tree.with_credit(NodeCredit(z=with_root(c.z), V=with_root(c.V), q=with_root(c.q), tau=c.tau))


def is_zero_variance(tree: RolloutTree) -> bool:
    """No signal: K < 2 leaves, or a leaf-reward sample std below the threshold standardization uses (so
    z ≡ 0, V ≡ 0, q ≡ 1/2): `zero_var_trees = drop` removes such trees (docs/algorithm.md §10)."""
    r = tree.leaf_rewards()
    return len(r) < 2 or float(np.std(r, ddof=1)) < ZERO_STD


def no_signal_stats(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """`learner/no_signal_frac`: trees with no signal (single-member groups, single-leaf trees, all leaf
    rewards equal); `tree/unbranched_frac`: trees where no branch could grow (every trunk one turn, or N = 0):
    their credit is a flat group's."""
    n = max(len(trees), 1)
    unbranched = sum(all(len(c) <= 1 for c in t.children[1:]) for t in trees)
    return {
        "learner/no_signal_frac": sum(map(is_zero_variance, trees)) / n,
        "tree/unbranched_frac": unbranched / n,
    }
