"""Tests for system.teacher: tau calibration, odds/logistic teachers, credit_tree (§4, §6, §7.2, §10)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from treegen import REWARD_KINDS, random_rewards, random_tree, tree_strategy

from system.credit import (
    WEIGHT_OPTIONS,
    TreeCredit,
    backup_credit,
    backup_weights,
    credit_tree,
    standardize_rewards,
)
from system.reference import ref_backup, ref_odds_teacher, ref_standardize, ref_tau
from system.teacher import calibrate_tau, global_tau, logistic_teacher, teacher_targets

NAN = math.nan

# ---------------------------------------------------------------- tau


def test_calibrate_tau_hand_worked():
    # K = 12, rho = 0.1: tau = 11 / (0.1 * sqrt(12)) = 11 / (0.1 * 3.464102) = 31.754265
    assert calibrate_tau(12, 0.1) == pytest.approx(31.754265, abs=1e-6)
    # §4 table, K = 12: rho -> tau
    for rho, tau in [(0.01, 317.5), (0.05, 63.5), (0.25, 12.7), (0.40, 7.9)]:
        assert round(calibrate_tau(12, rho), 1) == tau
    # K = 2, rho = 0.25: tau = 1 / (0.25 sqrt 2) = 2.828427
    assert calibrate_tau(2, 0.25) == pytest.approx(2 * math.sqrt(2), rel=1e-15)


@pytest.mark.parametrize("rho", [0.0, -0.1, 0.5, 0.7, math.nan, math.inf])
def test_calibrate_tau_rejects_rho_outside_open_interval(rho):
    with pytest.raises(ValueError, match=r"rho.*\(0, 1/2\)"):
        calibrate_tau(12, rho)
    with pytest.raises(ValueError, match="rho"):
        global_tau(12, rho)
    with pytest.raises(ValueError, match="rho"):
        credit_tree([-1, -1], [0.0, 1.0], rho)


@pytest.mark.parametrize("k", [1, 0, -3, 2.5])
def test_calibrate_tau_rejects_small_or_fractional_k(k):
    with pytest.raises(ValueError, match="num_leaves"):
        calibrate_tau(k, 0.1)


def test_global_tau_is_conservative():
    # (K-1)/sqrt(K) increases in K, so tau(k_max) >= tau(K) for every K <= k_max
    assert global_tau(12, 0.1) == calibrate_tau(12, 0.1)
    assert all(global_tau(12, 0.1) > calibrate_tau(k, 0.1) for k in range(2, 12))


# ---------------------------------------------------------------- teacher maps


def test_teacher_targets_hand_worked():
    # tau = 31.754265 (K = 12, rho = 0.1)
    # V = +1: q = 0.5 + 1/31.754265 = 0.531492; r* = (31.754265 + 2)/(31.754265 - 2) = 1.134435
    # V = -1: q = 0.468508; r* = 29.754265/33.754265 = 0.881496
    # V = (K-1)/sqrt(K) = 3.175426 (the max): q = 0.5 + rho = 0.6, r* = 0.6/0.4 = 1.5
    tau = calibrate_tau(12, 0.1)
    q, r = teacher_targets([1.0, -1.0, 11 / math.sqrt(12)], tau)
    np.testing.assert_allclose(q, [0.531492, 0.468508, 0.6], atol=1e-6)
    np.testing.assert_allclose(r, [1.134435, 0.881496, 1.5], atol=1e-6)
    np.testing.assert_allclose(r, q / (1 - q), rtol=1e-14)


def test_teacher_targets_no_tau_is_neutral():
    q, r = teacher_targets([0.0, 0.0], None)
    np.testing.assert_array_equal(q, [0.5, 0.5])
    np.testing.assert_array_equal(r, [1.0, 1.0])


def test_teacher_targets_rejects_broken_bound():
    # tau = 2: V = 1.2 gives q = 1.1
    with pytest.raises(ValueError, match=r"q\[1\] = 1\.1"):
        teacher_targets([0.0, 1.2], 2.0)
    with pytest.raises(ValueError, match="outside"):
        teacher_targets([-1.0], 2.0)  # q = 0 exactly: r* would be 0
    with pytest.raises(ValueError, match="tau"):
        teacher_targets([0.0], -1.0)


def test_logistic_teacher_hand_worked():
    # tau = 31.754265, tau' = tau/4 = 7.938566; V = 1: x = 0.125967
    # q = sigmoid(0.125967) = 0.531450; r* = e^0.125967 = 1.134245 (odds teacher: 0.531492, 1.134435)
    tau = calibrate_tau(12, 0.1)
    q, r = logistic_teacher([0.0, 1.0, -1.0], tau)
    np.testing.assert_allclose(q, [0.5, 0.531450, 0.468550], atol=1e-6)
    np.testing.assert_allclose(r, [1.0, 1.134245, 1 / 1.134245], atol=1e-6)
    np.testing.assert_allclose(q, r / (1 + r), rtol=1e-14)
    # same slope at V = 0 as the odds teacher: dq/dV = 1/tau
    h = 1e-6
    slope = (logistic_teacher([h], tau)[0][0] - logistic_teacher([-h], tau)[0][0]) / (2 * h)
    assert slope == pytest.approx(1 / tau, rel=1e-8)
    q_none, r_none = logistic_teacher([0.0, 0.0], None)
    assert np.all(q_none == 0.5) and np.all(r_none == 1.0)
    assert np.all(np.isfinite(logistic_teacher([-1e4, 1e4], 1.0)[0]))  # no overflow in the sigmoid


# ---------------------------------------------------------------- credit_tree

# prompt -> 0 -> 1 (leaf R=1);  0 -> 2 (leaf R=0);  prompt -> 3 (leaf R=0)
# R = [1, 0, 0] on leaves 1, 2, 3: z = [1.154699, -0.577349, -0.577349] (test_credit's hand-worked z)
# V0 = (z1 + z2)/2 = 0.288675; V3 = -0.577349;  K = 3, rho = 0.25: tau = 2/(0.25 sqrt 3) = 4.618802
# q0 = 0.5 + 0.288675/4.618802 = 0.5625;  q1 = 0.5 + 1.154699/4.618802 = 0.75 (the bound 1/2 + rho)
TREE = [-1, 0, 0, -1]
REWARDS = [NAN, 1.0, 0.0, 0.0]


def test_credit_tree_hand_worked():
    tc = credit_tree(TREE, REWARDS, 0.25)
    assert isinstance(tc, TreeCredit)
    assert tc.num_leaves == 3
    assert tc.tau == pytest.approx(4.618802, abs=1e-6)
    assert math.isnan(tc.z[0])
    np.testing.assert_allclose(tc.z[1:], [1.154699, -0.577349, -0.577349], atol=1e-6)
    np.testing.assert_allclose(tc.V, [0.288675, 1.154699, -0.577349, -0.577349], atol=1e-6)
    np.testing.assert_allclose(tc.q, [0.5625, 0.75, 0.375, 0.375], atol=1e-6)
    np.testing.assert_allclose(tc.r_star, tc.q / (1 - tc.q), rtol=1e-14)


def test_credit_tree_global_tau_and_listwise_and_logistic():
    tc = credit_tree(TREE, REWARDS, 0.25, tau_mode="global", k_nominal=12)
    assert tc.tau == calibrate_tau(12, 0.25)  # 11/(0.25 sqrt 12) = 12.701706 > 4.618802
    assert np.all(np.abs(tc.q - 0.5) < 0.25 * 4.618802 / 12.701706 + 1e-12)
    # listwise, with s = sd1 + eps = sqrt(1/3) + 1e-6: z = (2/3, -1/3, -1/3)/s, V0 = (1/6)/s,
    # V_prompt = (V0 + z3)/2 = -(1/12)/s; A0 = (1/4)/s = 0.433012, A3 = z3 - V_prompt = -(1/4)/s,
    # A1 = z1 - V0 = (2/3 - 1/6)/s = (1/2)/s, A2 = z2 - V0 = (-1/3 - 1/6)/s = -(1/2)/s
    lw = credit_tree(TREE, REWARDS, 0.1, credit="listwise")
    s = math.sqrt(1 / 3) + 1e-6
    np.testing.assert_allclose(lw.V, [0.25 / s, 0.5 / s, -0.5 / s, -0.25 / s], rtol=0, atol=1e-14)
    lg = credit_tree(TREE, REWARDS, 0.25, teacher="logistic")
    np.testing.assert_allclose(lg.q, logistic_teacher(lg.V, lg.tau)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="k_nominal"):
        credit_tree(TREE, REWARDS, 0.25, tau_mode="global")
    with pytest.raises(ValueError, match="K=3 leaves, more than k_nominal=2"):
        credit_tree(TREE, REWARDS, 0.25, tau_mode="global", k_nominal=2)
    with pytest.raises(ValueError, match="tau_mode"):
        credit_tree(TREE, REWARDS, 0.25, tau_mode="per_batch")
    with pytest.raises(ValueError, match="teacher"):
        credit_tree(TREE, REWARDS, 0.25, teacher="softmax")


@pytest.mark.parametrize("weights", WEIGHT_OPTIONS)
def test_all_equal_rewards_give_neutral_teacher(weights):
    # §10: sd1 = 0 -> z = V = 0, q = 1/2, r* = 1; tau is still defined (K = 12 >= 2)
    t = random_tree(np.random.default_rng(1), 4, 2)
    r = np.where(t.leaf, 1.0, NAN)
    tc = credit_tree(
        t.parents, r, 0.1, weights, turn_logprob_sums=t.turn_logprob_sums, turn_lengths=t.turn_lengths
    )
    assert np.all(tc.z[t.leaf] == 0.0) and np.all(tc.V == 0.0)
    assert np.all(tc.q == 0.5) and np.all(tc.r_star == 1.0)
    assert tc.tau == calibrate_tau(tc.num_leaves, 0.1)


@pytest.mark.parametrize("teacher", ["odds", "logistic"])
def test_single_leaf_has_no_tau(teacher):
    # §10: K = 1 (one chain of 3 turns) -> tau None, V = 0, q = 1/2, r* = 1, no division by tau
    for mode, k_nom in [("per_tree", None), ("global", 12)]:
        tc = credit_tree([-1, 0, 1], [NAN, NAN, 1.0], 0.1, teacher=teacher, tau_mode=mode, k_nominal=k_nom)
        assert tc.tau is None and tc.num_leaves == 1
        assert np.all(tc.V == 0.0) and np.all(tc.q == 0.5) and np.all(tc.r_star == 1.0)


def test_credit_tree_validates_rewards():
    with pytest.raises(ValueError, match="internal node 0"):
        credit_tree(TREE, [0.5, 1.0, 0.0, 0.0], 0.1)
    with pytest.raises(ValueError, match="leaf node 2"):
        credit_tree(TREE, [NAN, 1.0, NAN, 0.0], 0.1)
    with pytest.raises(ValueError, match="leaf node 3"):
        credit_tree(TREE, [NAN, 1.0, 0.0, math.inf], 0.1)
    with pytest.raises(ValueError, match="shape"):
        credit_tree(TREE, [NAN, 1.0], 0.1)
    with pytest.raises(ValueError, match="cycle"):
        credit_tree([1, 0], [NAN, NAN], 0.1)


def test_ddof0_misuse_breaks_the_bound():
    # K = 12, rho = 0.49, one success. Population std: max |z0| = sqrt(11) = 3.316625,
    # tau = 11/(0.49 sqrt 12) = 6.480462, so q = 0.5 + 3.316625/6.480462 = 1.011788 > 1 (doc: 1.0118).
    r = np.zeros(12)
    r[0] = 1.0
    z0 = (r - r.mean()) / np.std(r)  # ddof = 0: the bug
    tau = calibrate_tau(12, 0.49)
    q0 = 0.5 + z0 / tau
    assert q0.max() == pytest.approx(1.011788, abs=1e-6)
    with pytest.raises(ValueError, match="outside"):
        teacher_targets(z0, tau)
    # the correct ddof = 1 z stays inside: q <= 0.5 + 0.49 = 0.99
    q1, _ = teacher_targets(standardize_rewards(r), tau)
    assert q1.max() <= 0.99


# ---------------------------------------------------------------- §7.2 bounds and commute, random trees

CELLS = [(m, n, rho) for (m, n) in [(4, 2), (8, 0), (2, 6), (2, 2), (4, 0)] for rho in (0.1, 0.25, 0.45)]
TREES_PER_CELL = 40


def _children_mean(parents, w, x):
    """sum_c w_c x_c under each node (NaN where a node has no children)."""
    n = len(parents)
    inner = parents >= 0
    s = np.bincount(parents[inner], weights=(w * x)[inner], minlength=n)
    return np.where(np.bincount(parents[inner], minlength=n) > 0, s, NAN)


@pytest.mark.parametrize(("m", "n", "rho"), CELLS)
def test_bounds_and_commute_on_random_trees(m, n, rho):
    rng = np.random.default_rng(1000 * m + 10 * n + int(100 * rho))
    q_lo = r_lo = math.inf
    ratio = q_hi = r_hi = logistic_err = -math.inf
    for i in range(TREES_PER_CELL):
        t = random_tree(rng, m, n, 8, shuffle=True)
        r = random_rewards(rng, t.leaf, REWARD_KINDS[i % 3])
        lp, ln = t.turn_logprob_sums, t.turn_lengths
        for weights in WEIGHT_OPTIONS:
            tc = credit_tree(t.parents, r, rho, weights, turn_logprob_sums=lp, turn_lengths=ln)
            if tc.tau is None:
                continue
            ratio = max(ratio, np.max(np.abs(tc.V)) / tc.tau / rho)
            q_lo, q_hi = min(q_lo, tc.q.min()), max(q_hi, tc.q.max())
            r_lo, r_hi = min(r_lo, tc.r_star.min()), max(r_hi, tc.r_star.max())
            w = backup_weights(t.parents, weights, lp, ln)
            inner = ~t.leaf
            # odds teacher commutes with the backup: q_i = sum_c w_ic q_c
            np.testing.assert_allclose(
                tc.q[inner], _children_mean(t.parents, w, tc.q)[inner], rtol=0, atol=1e-12
            )
            # ... equivalently, backing up the leaf q gives the teacher of the backed-up V
            q_leaf = np.where(t.leaf, tc.q, NAN)
            np.testing.assert_allclose(backup_credit(t.parents, q_leaf, weights, lp, ln), tc.q, atol=1e-12)
            if inner.any():
                lq, _ = logistic_teacher(tc.V, tc.tau)
                err = np.abs(lq - _children_mean(t.parents, w, lq))[inner]
                logistic_err = max(logistic_err, err.max())
    assert ratio < 1 + 1e-12
    assert ratio > 0.9999  # one-success trees reach the bound up to the epsilon: the calibration is tight
    assert 0.5 - rho - 1e-12 <= q_lo and q_hi <= 0.5 + rho + 1e-12
    assert q_hi == pytest.approx(0.5 + rho, abs=1e-4)
    assert (1 - 2 * rho) / (1 + 2 * rho) * (1 - 1e-12) <= r_lo
    assert r_hi <= (1 + 2 * rho) / (1 - 2 * rho) * (1 + 1e-12)
    if rho == 0.25 and n > 0:  # (needs branching nodes: on a chain every teacher commutes)
        assert logistic_err > 1e-4  # doc: ~8e-3; the logistic teacher does not commute


@settings(max_examples=60, deadline=None)
@given(
    tree=tree_strategy(m=(1, 4), n=(0, 3)),
    weights=st.sampled_from(WEIGHT_OPTIONS),
    rho=st.sampled_from([0.01, 0.1, 0.25, 0.45]),
    kind=st.sampled_from(REWARD_KINDS),
    seed=st.integers(0, 2**32 - 1),
)
def test_credit_tree_matches_reference_pipeline(tree, weights, rho, kind, seed):
    r = random_rewards(np.random.default_rng(seed), tree.leaf, kind)
    lp, ln = tree.turn_logprob_sums, tree.turn_lengths
    tc = credit_tree(tree.parents, r, rho, weights, turn_logprob_sums=lp, turn_lengths=ln)
    leaves = np.flatnonzero(tree.leaf)
    z = np.full(tree.num_nodes, NAN)
    z[leaves] = ref_standardize([float(x) for x in r[leaves]])
    np.testing.assert_allclose(tc.z, z, rtol=0, atol=1e-12)
    v = ref_backup(tree.parents.tolist(), z.tolist(), weights, lp.tolist(), ln.tolist())
    np.testing.assert_allclose(tc.V, v, rtol=0, atol=1e-12)
    if len(leaves) < 2:
        assert tc.tau is None and np.all(tc.q == 0.5)
        return
    tau = ref_tau(len(leaves), rho)
    assert tc.tau == pytest.approx(tau, rel=1e-15)
    q, rs = zip(*(ref_odds_teacher(x, tau) for x in v), strict=True)
    np.testing.assert_allclose(tc.q, q, rtol=0, atol=1e-12)
    np.testing.assert_allclose(tc.r_star, rs, rtol=1e-10)
