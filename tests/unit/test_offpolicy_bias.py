"""The statistics of the first-step gradient-bias experiment (experiments/offpolicy_bias.py)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.offpolicy_bias import bias_table, jackknife, unbiased_sq_norm


def test_unbiased_sq_norm_is_the_mean_of_cross_products():
    # rows (1, 0), (3, 0): ‖Σ‖² = 16, Σ‖v‖² = 10, (16 − 10) / (2 · 1) = 3 = v₁·v₂ (the only pair)
    assert unbiased_sq_norm(np.array([[1.0, 0.0], [3.0, 0.0]])) == 3.0
    # pure noise around 0: the estimate of ‖E v‖² = 0 is centred on 0 (the plain ‖mean‖² would be ≈ 50/n)
    rng = np.random.default_rng(0)
    estimates = [unbiased_sq_norm(rng.normal(size=(20, 50))) for _ in range(400)]
    assert abs(np.mean(estimates)) < 0.05 and np.mean(estimates) < 50 / 20 / 10


def test_jackknife_se_of_a_mean_is_the_usual_standard_error():
    x = np.array([1.0, 2.0, 4.0, 7.0])
    value, se = jackknife(lambda r: float(r.mean()), [x])
    assert value == 3.5 and se == pytest.approx(x.std(ddof=1) / 2.0, rel=1e-12)  # sd / √4


def test_bias_table_scores_a_biased_mode_above_an_unbiased_one():
    # on-policy batches around g = (1, 0); "none" shifted by (0, 1) (bias² = 1 relative to ‖g‖² = 1);
    # "exact" the same distribution as on-policy: bias² ≈ 0, below none's by ≈ 1
    rng = np.random.default_rng(1)
    n, noise = 200, 0.05
    on = np.array([1.0, 0.0]) + noise * rng.normal(size=(n, 2))
    modes = {
        "π_prox, none": np.array([1.0, 1.0]) + noise * rng.normal(size=(n, 2)),
        "exact": np.array([1.0, 0.0]) + noise * rng.normal(size=(n, 2)),
    }
    rows = {r["mode"]: r for r in bias_table(on, modes, per_batch=8)}
    assert rows["π_prox, none"]["rel_sq_bias"] == pytest.approx(1.0, abs=0.02)
    assert rows["exact"]["rel_sq_bias"] == pytest.approx(0.0, abs=0.01)
    assert rows["exact"]["below_base"] == pytest.approx(1.0, abs=0.02)
    assert rows["exact"]["below_base"] > 10 * rows["exact"]["below_base_se"]
    assert rows["π_prox, none"]["rel_variance"] == 1.0 and rows["exact"]["base"] == "π_prox, none"
