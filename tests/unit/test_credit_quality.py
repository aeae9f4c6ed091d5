"""AUC (Mann–Whitney, ties half) and the paired tree bootstrap of system/credit_quality.py, hand-worked."""

import numpy as np
import pytest

from system.credit_quality import auc, bootstrap_counts, pair_matrix, paired_bootstrap


def test_auc_perfect_and_reversed():
    # every positive (0.8, 0.9) above every negative (0.1, 0.2): 4 of 4 pairs -> 1; swapped -> 0
    assert auc([0.1, 0.9, 0.2, 0.8], [False, True, False, True]) == 1.0
    assert auc([0.1, 0.9, 0.2, 0.8], [True, False, True, False]) == 0.0


def test_auc_all_tied_is_one_half():
    # 2 positives x 3 negatives, every pair tied: 6 * 1/2 / 6 = 0.5
    assert auc([0.0] * 5, [True, True, False, False, False]) == 0.5


def test_auc_worked_three_by_two():
    # pos = (0.9, 0.5, 0.3), neg = (0.5, 0.1)
    # 0.9: above both -> 2; 0.5: tie with 0.5 (1/2) + above 0.1 (1) -> 1.5; 0.3: above 0.1 only -> 1
    # U = 4.5 of 3 * 2 = 6 pairs -> 0.75
    scores = [0.9, 0.5, 0.5, 0.3, 0.1]
    labels = [True, True, False, True, False]
    assert auc(scores, labels) == pytest.approx(0.75, abs=1e-15)


def test_auc_undefined_without_both_classes_and_rejects_bad_input():
    assert np.isnan(auc([1.0, 2.0], [True, True]))
    assert np.isnan(auc([], []))
    with pytest.raises(ValueError, match="same length"):
        auc([1.0], [True, False])
    with pytest.raises(ValueError, match="not finite"):
        auc([1.0, np.nan], [True, False])


def test_pair_matrix_decomposes_the_auc():
    # tree 0: pos 0.9, neg 0.5; tree 1: pos 0.5 and 0.3, neg 0.1
    # U[0,0] = [0.9>0.5] = 1; U[0,1] = [0.9>0.1] = 1; U[1,0] = tie(0.5,0.5) 1/2 + 0 = 0.5; U[1,1] = 1 + 1 = 2
    # P = (1, 2), N = (1, 1): AUC = (1 + 1 + 0.5 + 2) / (3 * 2) = 0.75, the 3x2 example again
    m = pair_matrix([0.9, 0.5, 0.5, 0.3, 0.1], [True, False, True, True, False], [0, 0, 1, 1, 1], 2)
    np.testing.assert_array_equal(m.u, [[1.0, 1.0], [0.5, 2.0]])
    np.testing.assert_array_equal(m.pos, [1.0, 2.0])
    np.testing.assert_array_equal(m.neg, [1.0, 1.0])
    assert m.auc()[0] == pytest.approx(0.75)
    # within-tree pairs only: (U00 + U11) / (P0 N0 + P1 N1) = (1 + 2) / (1 + 2) = 1
    assert m.within_auc()[0] == 1.0
    # tree 1 twice, tree 0 dropped: pos (0.5, 0.3, 0.5, 0.3), neg (0.1, 0.1): all 8 pairs above -> 1
    assert m.auc([[0.0, 2.0]])[0] == 1.0


def test_resampled_auc_equals_the_auc_of_the_repeated_data():
    rng = np.random.default_rng(5)
    groups = rng.integers(0, 6, size=60)
    scores = rng.integers(0, 4, size=60).astype(float)  # few values: many ties
    labels = rng.random(60) < 0.4
    m = pair_matrix(scores, labels, groups, 6)
    counts = np.array([2.0, 0.0, 1.0, 3.0, 0.0, 0.0])
    reps = np.repeat(np.arange(60), counts[groups].astype(int))
    assert m.auc(counts)[0] == pytest.approx(auc(scores[reps], labels[reps]), abs=1e-12)
    assert m.auc()[0] == pytest.approx(auc(scores, labels), abs=1e-12)


def test_bootstrap_counts_keep_stratum_sizes_and_are_seeded():
    strata = ["a", "a", "a", "b", "b"]
    c = bootstrap_counts(strata, 50, seed=3)
    assert c.shape == (50, 5)
    np.testing.assert_array_equal(c[:, :3].sum(axis=1), 3)  # three "a" trees drawn per replicate
    np.testing.assert_array_equal(c[:, 3:].sum(axis=1), 2)
    np.testing.assert_array_equal(c, bootstrap_counts(strata, 50, seed=3))
    assert not np.array_equal(c, bootstrap_counts(strata, 50, seed=4))


def test_two_tree_bootstrap_worked():
    # tree a: pos 1, neg 0 (AUC 1 alone); tree b: pos 0, neg 1 (AUC 0 alone). Both once: pairs
    # (1,0) 1, (1,1) 1/2, (0,0) 1/2, (0,1) 0 -> 2/4 = 0.5. A replicate draws 2 trees with replacement:
    # {a,a} -> 1 (p 1/4), {a,b} -> 0.5 (p 1/2), {b,b} -> 0 (p 1/4), so the 2.5/97.5 percentiles are 0 and 1.
    # The same signal under another name: the paired difference is 0 in every replicate.
    scores, labels, groups = [1.0, 0.0, 0.0, 1.0], [True, False, True, False], [0, 0, 1, 1]
    out = paired_bootstrap(
        {"x": scores, "y": scores}, labels, groups, n_boot=400, seed=0, diffs=[("x", "y")], within=True
    )
    assert out["x"] == 0.5 and out["x_lo"] == 0.0 and out["x_hi"] == 1.0
    assert out["x_minus_y"] == out["x_minus_y_lo"] == out["x_minus_y_hi"] == 0.0
    # within-tree: a contributes 1 of 1 pair, b 0 of 1: (c_a * 1 + c_b * 0) / (c_a + c_b) -> 0.5, in [0, 1]
    assert out["x_within"] == 0.5 and out["x_within_lo"] == 0.0 and out["x_within_hi"] == 1.0


def test_paired_difference_and_determinism():
    rng = np.random.default_rng(1)
    groups = np.repeat(np.arange(30), 10)
    labels = rng.random(300) < 0.5
    good = labels + rng.normal(0, 0.5, 300)  # informative signal
    noise = rng.normal(0, 1, 300)
    strata = np.arange(30) % 3
    kw = {"n_boot": 300, "seed": 7, "diffs": [("good", "noise")]}
    out = paired_bootstrap({"good": good, "noise": noise}, labels, groups, strata, **kw)
    assert out == paired_bootstrap({"good": good, "noise": noise}, labels, groups, strata, **kw)
    for name in ("good", "noise", "good_minus_noise"):
        assert out[f"{name}_lo"] <= out[name] <= out[f"{name}_hi"]
    assert out["good_minus_noise"] == pytest.approx(out["good"] - out["noise"])
    assert out["good_minus_noise_lo"] > 0.2  # a clear gap, resolved by the paired interval
    assert out["good_lo"] > 0.75 and out["noise_lo"] < 0.5 < out["noise_hi"]


def test_undefined_auc_reports_none():
    out = paired_bootstrap({"x": [1.0, 2.0]}, [True, True], [0, 1], n_boot=20, seed=0)
    assert out == {"x": None, "x_lo": None, "x_hi": None}
    with pytest.raises(ValueError, match="strata"):
        paired_bootstrap({"x": [1.0, 2.0]}, [True, False], [0, 1], strata=[0], n_boot=5)
