"""Tests for system.credit: standardization (§3.1, §7.1), backup (§3.2, §7.6), validation (§10)."""

import itertools
import math
import time
from math import comb

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from treegen import random_rewards, random_tree, tree_strategy

from system.credit import WEIGHT_OPTIONS, backup_credit, backup_weights, standardize_rewards
from system.parents import leaf_mask, tree_depths
from system.reference import ref_backup, ref_standardize

NAN = math.nan

# ---------------------------------------------------------------- standardization (§3.1)


def test_standardize_hand_worked_one_of_three():
    # R = [1, 0, 0]: mean 1/3; deviations 2/3, -1/3, -1/3
    # sd1 = sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt((4/9 + 2/9) / 2) = sqrt(1/3) = 0.57735
    # z_0 = (2/3) / (0.57735 + 1e-6) = 1.1546985;  z_1 = z_2 = -(1/3) / (0.57735 + 1e-6) = -0.5773493
    z = standardize_rewards([1, 0, 0])
    sd1 = math.sqrt(1 / 3)
    np.testing.assert_allclose(z, [(2 / 3) / (sd1 + 1e-6), -(1 / 3) / (sd1 + 1e-6), -(1 / 3) / (sd1 + 1e-6)])
    np.testing.assert_allclose(z, [1.1547, -0.57735, -0.57735], atol=5e-5)  # the epsilon costs ~2e-6
    assert z.dtype == np.float64


def test_standardize_matches_textbook_formula():
    rng = np.random.default_rng(0)
    for k in (2, 3, 7, 12):
        r = rng.random(k)
        np.testing.assert_allclose(standardize_rewards(r), ref_standardize(list(r)), rtol=0, atol=1e-13)


@pytest.mark.parametrize("rewards", [[], [0.7], [1.0, 1.0, 1.0], [0.3] * 12, [5.0, 5.0 + 1e-14]])
def test_standardize_no_signal_is_zero(rewards):
    # K < 2, all equal, or sd1 < 1e-12 (§10)
    z = standardize_rewards(rewards)
    assert z.shape == (len(rewards),)
    assert np.all(z == 0.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_standardize_rejects_non_finite_naming_index(bad):
    with pytest.raises(ValueError, match="index 2"):
        standardize_rewards([0.0, 1.0, bad, 1.0])


def test_standardize_rejects_2d():
    with pytest.raises(ValueError, match="1-D"):
        standardize_rewards([[0.0, 1.0]])


# §7.1 table: K, (K-1)/sqrt(K) (ddof=1), sqrt(K-1) (ddof=0)
TABLE_7_1 = [
    (2, 0.7071, 1.0000),
    (4, 1.5000, 1.7321),
    (8, 2.4749, 2.6458),
    (12, 3.1754, 3.3166),
    (14, 3.4744, 3.6056),
    (32, 5.4801, 5.5678),
]


@pytest.mark.parametrize(("k", "bound1", "bound0"), TABLE_7_1)
def test_max_abs_z_is_samuelson_bound(k, bound1, bound0):
    exact1 = (k - 1) / math.sqrt(k)
    assert round(exact1, 4) == bound1
    assert round(math.sqrt(k - 1), 4) == bound0
    one_hot = np.zeros(k)
    one_hot[0] = 1.0
    z = standardize_rewards(one_hot)
    # attained up to the epsilon: z_0 = d / (sd + 1e-6) with d/sd = (K-1)/sqrt(K)
    sd1 = np.std(one_hot, ddof=1)
    assert np.max(np.abs(z)) <= exact1
    assert np.max(np.abs(z)) == pytest.approx(exact1 * sd1 / (sd1 + 1e-6), rel=1e-12)
    assert np.max(np.abs(z)) == pytest.approx(exact1, rel=1e-5)
    # population std (ddof=0) would reach sqrt(K-1) instead: the larger bound
    d = one_hot - one_hot.mean()
    assert np.max(np.abs(d)) / np.std(one_hot) == pytest.approx(math.sqrt(k - 1), rel=1e-12)
    rng = np.random.default_rng(k)
    worst = max(
        np.max(np.abs(standardize_rewards(r)))
        for r in itertools.chain(rng.integers(0, 2, (300, k)).astype(float), rng.random((300, k)))
    )
    assert worst <= exact1


# ---------------------------------------------------------------- backup (§3.2), hand-worked

# prompt -> 0 -> 1 -> 2 (leaf z=+1.0)          trajectory A, turns 1..3
#             \    \-> 6 (leaf z=0.0)          branch from anchor 2 of A
#              \-> 3 (leaf z=-0.5)             branch from anchor 1 of A
#              \-> 4 (leaf z=+0.25, ell=0)     second branch from anchor 1 (duplicate anchor: 3 children)
# prompt -> 5 (leaf z=-0.75)                   trajectory B, T = 1
PARENTS = [-1, 0, 1, 0, 0, -1, 1]
Z = [NAN, NAN, 1.0, -0.5, 0.25, -0.75, 0.0]
LP = [-0.5, -2.0, -1.0, -3.0, 0.0, -3.0, -4.0]  # per-turn sums of behavior log-probs
LEN = [1, 2, 1, 1, 0, 3, 2]  # model tokens per turn; node 4 has none


def test_backup_uniform_hand_worked():
    # V1 = (1.0 + 0.0)/2 = 0.5;  V0 = (V1 + V3 + V4)/3 = (0.5 - 0.5 + 0.25)/3 = 0.083333
    v = backup_credit(PARENTS, Z)
    np.testing.assert_allclose(v, [0.25 / 3, 0.5, 1.0, -0.5, 0.25, -0.75, 0.0], rtol=0, atol=1e-15)


def test_backup_leaf_count_hand_worked():
    # node 0: children 1, 3, 4 hold 2, 1, 1 leaves -> V0 = (2*0.5 - 0.5 + 0.25)/4 = 0.1875
    # = mean of the leaf z under 0: (1.0 + 0.0 - 0.5 + 0.25)/4
    v = backup_credit(PARENTS, Z, "leaf_count")
    np.testing.assert_allclose(v[:2], [0.1875, 0.5], rtol=0, atol=1e-15)


def test_backup_geo_likelihood_hand_worked():
    # node 1: log u2 = -1/1, log u6 = -4/2 = -2 -> w2 = 1/(1+e^-1) = 0.731059; V1 = 0.731059
    # node 0: u1 = e^(-2/2) = 0.367879, u3 = e^(-3/1) = 0.049787, u4 = e^0 = 1 (ell = 0 -> weight 1)
    #   sum 1.417667 -> w = (0.259496, 0.035119, 0.705385)
    #   V0 = 0.259496*0.731059 + 0.035119*(-0.5) + 0.705385*0.25 = 0.348494
    v = backup_credit(PARENTS, Z, "geo_likelihood", LP, LEN)
    np.testing.assert_allclose(v[:2], [0.348494, 0.731059], atol=1e-6)
    w = backup_weights(PARENTS, "geo_likelihood", LP, LEN)
    np.testing.assert_allclose(w[[1, 3, 4]], [0.259496, 0.035119, 0.705385], atol=1e-6)


def test_backup_seq_likelihood_hand_worked():
    # node 1: u2 = e^-1, u6 = e^-4 -> w2 = 1/(1+e^-3) = 0.952574; V1 = 0.952574
    # node 0: u1 = e^-2 = 0.135335, u3 = e^-3 = 0.049787, u4 = e^0 = 1; sum 1.185122
    #   V0 = (0.135335*0.952574 - 0.049787*0.5 + 0.25)/1.185122 = 0.298723
    v = backup_credit(PARENTS, Z, "seq_likelihood", LP, LEN)
    np.testing.assert_allclose(v[:2], [0.298723, 0.952574], atol=1e-6)


def test_backup_listwise_hand_worked():
    # uniform V = [1/12, 0.5, 1, -0.5, 0.25, -0.75, 0];  V_prompt = (1/12 - 0.75)/2 = -1/3
    # A0 = 1/12 + 1/3 = 0.416667; A5 = -0.75 + 1/3 = -0.416667; A1 = 0.5 - 1/12; A2 = 1 - 0.5;
    # A3 = -0.5 - 1/12; A4 = 0.25 - 1/12; A6 = 0 - 0.5
    a = backup_credit(PARENTS, Z, credit="listwise")
    want = [5 / 12, 5 / 12, 0.5, -7 / 12, 1 / 6, -5 / 12, -0.5]
    np.testing.assert_allclose(a, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("weights", WEIGHT_OPTIONS)
def test_listwise_sums_to_zero_under_every_parent(weights):
    # sum_c w_ic (V_c - V_i) = 0: the property that forces siblings to opposite signs (§3.2)
    t = random_tree(np.random.default_rng(3), 4, 2)
    z = random_rewards(np.random.default_rng(4), t.leaf, "uniform")
    a = backup_credit(t.parents, z, weights, t.turn_logprob_sums, t.turn_lengths, credit="listwise")
    w = backup_weights(t.parents, weights, t.turn_logprob_sums, t.turn_lengths)
    slot = np.where(t.parents < 0, t.num_nodes, t.parents)
    sums = np.bincount(slot, weights=w * a, minlength=t.num_nodes + 1)
    np.testing.assert_allclose(sums, 0.0, atol=1e-14)


def test_chain_of_zero_length_turns_passes_value_up():
    # prompt -> 0 (ell 0) -> 1 (ell 0) -> 2 (leaf z = 0.7, ell 0): every node inherits 0.7
    for w in WEIGHT_OPTIONS:
        v = backup_credit([-1, 0, 1], [NAN, NAN, 0.7], w, [0.0, 0.0, 0.0], [0, 0, 0])
        np.testing.assert_array_equal(v, [0.7, 0.7, 0.7])


def test_geo_zero_length_child_has_weight_one():
    # children of 0: node 1 with ell = 0 (u = 1) and node 2 with lp/ell = -ln 3 (u = 1/3)
    # w = (3/4, 1/4) -> V0 = 0.75*1.0 + 0.25*(-1.0) = 0.5
    v = backup_credit([-1, 0, 0], [NAN, 1.0, -1.0], "geo_likelihood", [0.0, 0.0, -2 * math.log(3)], [1, 0, 2])
    assert v[0] == pytest.approx(0.5, abs=1e-15)


@pytest.mark.parametrize("shift", [-5000.0, 800.0])
def test_seq_likelihood_is_shift_invariant_in_log_space(shift):
    # log mu = shift, shift - 1: naive exp under/overflows; the weights are still 1/(1+e^-1), e^-1/(1+e^-1)
    # V0 = 0.731059*1.0 + 0.268941*(-1.0) = 0.462117
    v = backup_credit([-1, 0, 0], [NAN, 1.0, -1.0], "seq_likelihood", [0.0, shift, shift - 1.0])
    assert v[0] == pytest.approx(math.tanh(0.5), abs=1e-15)


def test_node_order_does_not_matter():
    # same tree relabeled: V must follow the labels
    rng = np.random.default_rng(5)
    t = random_tree(rng, 4, 2)
    z = random_rewards(rng, t.leaf, "uniform")
    perm = rng.permutation(t.num_nodes)  # old node j -> new node perm[j]
    p2 = np.empty_like(t.parents)
    p2[perm] = np.where(t.parents < 0, -1, perm[np.maximum(t.parents, 0)])
    z2 = np.empty_like(z)
    z2[perm] = z
    lp2, ln2 = np.empty_like(t.turn_logprob_sums), np.empty_like(t.turn_lengths)
    lp2[perm], ln2[perm] = t.turn_logprob_sums, t.turn_lengths
    for w in WEIGHT_OPTIONS:
        v = backup_credit(t.parents, z, w, t.turn_logprob_sums, t.turn_lengths)
        v2 = backup_credit(p2, z2, w, lp2, ln2)
        np.testing.assert_allclose(v2[perm], v, rtol=0, atol=1e-14)


def test_leaf_count_is_mean_of_leaves_below():
    rng = np.random.default_rng(6)
    t = random_tree(rng, 4, 3, shuffle=True)
    z = random_rewards(rng, t.leaf, "uniform")
    below: dict[int, list[float]] = {i: [] for i in range(t.num_nodes)}
    for leaf in np.flatnonzero(t.leaf):
        j = leaf
        while j != -1:  # walk up to the prompt, crediting every ancestor
            below[j].append(z[leaf])
            j = t.parents[j]
    want = [np.mean(below[i]) for i in range(t.num_nodes)]
    np.testing.assert_allclose(backup_credit(t.parents, z, "leaf_count"), want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("weights", WEIGHT_OPTIONS)
def test_backup_weights_sum_to_one_per_sibling_group(weights):
    t = random_tree(np.random.default_rng(7), 4, 2)
    w = backup_weights(t.parents, weights, t.turn_logprob_sums, t.turn_lengths)
    slot = np.where(t.parents < 0, t.num_nodes, t.parents)
    sums = np.bincount(slot, weights=w, minlength=t.num_nodes + 1)
    has_kids = np.bincount(slot, minlength=t.num_nodes + 1) > 0
    np.testing.assert_allclose(sums[has_kids], 1.0, atol=1e-14)
    assert np.all(w >= 0)


def test_leaf_mask_and_depths():
    assert leaf_mask(PARENTS).tolist() == [False, False, True, True, True, True, True]
    assert tree_depths(PARENTS).tolist() == [1, 2, 3, 2, 2, 1, 3]
    assert leaf_mask([]).tolist() == [] and tree_depths([]).tolist() == []
    # any order: 2 -> 0 -> 1 -> prompt
    assert tree_depths([1, -1, 0]).tolist() == [2, 1, 3]


# ---------------------------------------------------------------- fast code == slow reference


@settings(max_examples=120, deadline=None)
@given(
    tree=tree_strategy(),
    weights=st.sampled_from(WEIGHT_OPTIONS),
    credit=st.sampled_from(["pointwise", "listwise"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_backup_matches_recursive_reference(tree, weights, credit, seed):
    z = random_rewards(np.random.default_rng(seed), tree.leaf, "uniform")
    lp, ln = tree.turn_logprob_sums, tree.turn_lengths
    fast = backup_credit(tree.parents, z, weights, lp, ln, credit)
    slow = ref_backup(tree.parents.tolist(), z.tolist(), weights, lp.tolist(), ln.tolist(), credit)
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("parents", "match"),
    [
        ([0], "cycle"),  # self-loop
        ([1, 0, -1], "cycle"),  # 0 <-> 1
        ([-1, 3, 1, 2, 1], r"cycle \(through node [123]\)"),  # 1 -> 3 -> 2 -> 1, node 4 hangs on it
        ([-1, 0, 5], "parent of node 2 is 5"),
        ([-1, -2], "parent of node 1 is -2"),
        ([-1, 0.5], r"parents\[1\]"),
        ([[-1]], "1-D"),
    ],
)
def test_invalid_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        backup_credit(parents, [NAN] * len(parents))
    with pytest.raises(ValueError, match=match):
        tree_depths(parents)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([NAN, NAN, 0.5], "leaf node 1"),  # leaf without a value
        ([NAN, math.inf, 0.5], "leaf node 1"),
        ([0.3, 0.1, 0.5], "internal node 0"),  # internal node with a value
        ([NAN, 0.1], r"shape \(3,\)"),
    ],
)
def test_invalid_leaf_values(values, match):
    with pytest.raises(ValueError, match=match):
        backup_credit([-1, 0, 0], values)


def test_invalid_options_and_inputs():
    p, v = [-1, 0, 0], [NAN, 1.0, 0.0]
    with pytest.raises(ValueError, match="weights must be one of"):
        backup_credit(p, v, "softmax")
    with pytest.raises(ValueError, match="credit must be one of"):
        backup_credit(p, v, credit="pairwise")
    with pytest.raises(ValueError, match="needs turn_logprob_sums"):
        backup_credit(p, v, "seq_likelihood")
    with pytest.raises(ValueError, match="needs turn_lengths"):
        backup_credit(p, v, "geo_likelihood", [0.0, -1.0, -1.0])
    with pytest.raises(ValueError, match=r"turn_logprob_sums\[2\] is not finite"):
        backup_credit(p, v, "seq_likelihood", [0.0, -1.0, -math.inf])
    with pytest.raises(ValueError, match=r"turn_lengths\[1\] is negative"):
        backup_credit(p, v, "geo_likelihood", [0.0, -1.0, -1.0], [1, -1, 1])
    with pytest.raises(ValueError, match="shape"):
        backup_credit(p, v, "seq_likelihood", [0.0, -1.0])


# ---------------------------------------------------------------- scale


def _shuffled_random_tree(n, rng):
    parents = rng.integers(-1, np.arange(n))  # random recursive tree: parent of i uniform on {-1..i-1}
    perm = rng.permutation(n)
    out = np.empty(n, dtype=np.int64)
    out[perm] = np.where(parents < 0, -1, perm[np.maximum(parents, 0)])
    return out


@pytest.mark.parametrize("shape", ["random", "chain"])
def test_100k_nodes_is_fast(shape):
    n = 100_000
    rng = np.random.default_rng(8)
    parents = _shuffled_random_tree(n, rng) if shape == "random" else np.arange(-1, n - 1)
    leaf = leaf_mask(parents)
    z = np.where(leaf, rng.normal(size=n), NAN)
    start = time.perf_counter()
    v = backup_credit(parents, z, "leaf_count")
    assert time.perf_counter() - start < 3.0  # measured ~0.02 s (random) / ~0.2 s (chain)
    assert np.all(np.isfinite(v))
    if shape == "chain":
        assert np.all(v == z[-1])


# ---------------------------------------------------------------- §7.6 backup-weight bias

# One node with 3 children sampled from mu. A turn is L tokens from {rare: p, common: 1-p}, p = 0.098; its
# value is +1 if it contains no rare token, else -1. So E_mu[V] = 2 (1-p)^L - 1 (+0.804 at L = 1).
P_RARE = 0.098


def _exact_estimator_mean(weights, L):
    """E over the 3 children of the backed-up V, enumerating the rare-token counts k_c in {0..L}."""
    ks = np.arange(L + 1)
    pk = np.array([comb(L, k) * P_RARE**k * (1 - P_RARE) ** (L - k) for k in ks])
    trip = np.array(list(itertools.product(ks, repeat=3)))  # (G, 3) count triples, one tree each
    g = len(trip)
    parents = np.concatenate([np.full(g, -1), np.repeat(np.arange(g), 3)])  # G nodes, then 3G leaves
    kc = trip.ravel()
    z = np.concatenate([np.full(g, NAN), np.where(kc == 0, 1.0, -1.0)])
    lp = np.concatenate([np.zeros(g), kc * math.log(P_RARE) + (L - kc) * math.log(1 - P_RARE)])
    ln = np.concatenate([np.ones(g), np.full(3 * g, L)])
    v = backup_credit(parents, z, weights, lp, ln)[:g]
    w = backup_weights(parents, weights, lp, ln)[g:].reshape(g, 3)
    prob = pk[trip].prod(axis=1)
    return float(prob @ v), float(prob @ (1.0 / (w**2).sum(axis=1)))  # mean estimate, mean ESS


@pytest.mark.parametrize("L", [1, 5, 50])
def test_backup_weight_bias_exact(L):
    truth = 2 * (1 - P_RARE) ** L - 1
    uni, uni_ess = _exact_estimator_mean("uniform", L)
    seq, seq_ess = _exact_estimator_mean("seq_likelihood", L)
    geo, geo_ess = _exact_estimator_mean("geo_likelihood", L)
    assert uni - truth == pytest.approx(0.0, abs=1e-12)  # uniform is exactly unbiased
    assert uni_ess == pytest.approx(3.0, abs=1e-9)
    if L == 1:
        # with j rare children out of 3 the seq estimate is ((3-j)(1-p) - j p) / ((3-j)(1-p) + j p):
        # j=0: 1;  j=1: (1.804 - 0.098)/(1.804 + 0.098) = 0.896951;
        # j=2: (0.902 - 0.196)/(0.902 + 0.196) = 0.642987;  j=3: -1
        est = [1.0, 1.706 / 1.902, 0.706 / 1.098, -1.0]
        want = sum(comb(3, j) * P_RARE**j * (1 - P_RARE) ** (3 - j) * est[j] for j in range(4))
        assert truth == pytest.approx(0.804, abs=1e-12)
        assert seq - truth == pytest.approx(want - truth, abs=1e-12)
        assert seq - truth == pytest.approx(0.1602, abs=1e-3)  # doc: +0.171 from 4,000 sampled trials
        assert geo == pytest.approx(seq, abs=1e-12)  # ell = 1: geo and seq weights coincide
    if L == 5:
        assert seq - truth > geo - truth > 0.1  # both mode-seeking; length-normalizing helps
    if L == 50:
        assert seq_ess < 1.4 < 2.9 < geo_ess  # doc: ESS 1.28 vs 2.98
        assert abs(geo - truth) < 0.005


def test_backup_weight_bias_sampled():
    # The doc's Monte-Carlo version, fixed seed: 4,000 trees of one node + 3 sampled children, L = 1.
    rng = np.random.default_rng(2024)
    g = 4000
    rare = rng.random(3 * g) < P_RARE
    parents = np.concatenate([np.full(g, -1), np.repeat(np.arange(g), 3)])
    z = np.concatenate([np.full(g, NAN), np.where(rare, -1.0, 1.0)])
    lp = np.concatenate([np.zeros(g), np.where(rare, math.log(P_RARE), math.log(1 - P_RARE))])
    truth = 1 - 2 * P_RARE
    se = 2 * math.sqrt(P_RARE * (1 - P_RARE) / (3 * g))  # std error of the uniform mean, ~0.0054
    uni = backup_credit(parents, z)[:g].mean()
    seq = backup_credit(parents, z, "seq_likelihood", lp)[:g].mean()
    assert abs(uni - truth) < 4 * se
    assert 0.13 < seq - truth < 0.19  # exact value 0.1602
