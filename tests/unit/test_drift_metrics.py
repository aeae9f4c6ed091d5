"""The drift figures the learner logs (learner/reference_pass.py, docs/algorithm.md §11.1) against their
closed form, the default correction at real per-token drift, and drift-bounded admission (system/staleness).

Closed form. With y ~ μ and per-token log r_t ~ N(−κ, 2κ) (so E_μ[r_t] = 1 and KL(μ‖π_prox) = κ per token), a
turn of L tokens has log W = Σ_t log r_t ~ N(−D, 2D), D = L·κ, and with X = log W, s = √(2D), c = log C:

    E[min(W, C)]    = Φ((c − D)/s) + C·(1 − Φ((c + D)/s))                       (IS mass kept)
    E[min(W, C)²]   = e^{2D} Φ((c − 3D)/s) + C²·(1 − Φ((c + D)/s))
    Kish ESS        = E[min(W, C)]² / E[min(W, C)²]                               (equal-length turns)
    P(W > C)        = 1 − Φ((c + D)/s)                                           (clipped share)

e.g. D = 1, C = 2: Φ(−0.217) + 2(1 − Φ(1.197)) = 0.414 + 0.231 = 0.645; ESS 0.645²/0.842 = 0.49;
clipped 0.116.
"""

from __future__ import annotations

import math

import pytest
import torch

from configs.schema import load_config
from learner.reference_pass import correction_metrics
from learner.rollout_correction import correction_weights
from storage.admission import Admission
from system.staleness import drift_lag, drift_warning


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _closed_form(d: float, c: float = 2.0) -> dict[str, float]:
    s, lc = math.sqrt(2 * d), math.log(c)
    tail = 1.0 - _phi((lc + d) / s)
    mean = _phi((lc - d) / s) + c * tail
    second = math.exp(2 * d) * _phi((lc - 3 * d) / s) + c * c * tail
    return {"weight_mean": mean, "turn_ess": mean * mean / second, "clipped_token_frac": tail}


def test_the_closed_form_matches_the_issue_figures():
    # the worked example above, and the mean weights quoted for C = 2 at D = 0.1 / 0.3 / 1 / 2
    assert _closed_form(1.0)["weight_mean"] == pytest.approx(0.645, abs=2e-3)
    assert [round(_closed_form(d)["weight_mean"], 2) for d in (0.1, 0.3, 1, 2)] == [0.98, 0.89, 0.65, 0.43]
    assert [round(_closed_form(d)["turn_ess"], 2) for d in (0.1, 0.3, 1, 2)] == [0.85, 0.71, 0.49, 0.33]


@pytest.mark.parametrize("turn_kl", [0.1, 0.3, 1.0, 2.0])
def test_logged_weight_ess_and_clipping_of_the_product_match_the_closed_form(turn_kl):
    turns, length = 20_000, 500
    kappa = turn_kl / length
    gen = torch.Generator().manual_seed(int(turn_kl * 10))
    log_r = -kappa + math.sqrt(2 * kappa) * torch.randn(turns * length, generator=gen, dtype=torch.float64)
    behavior = torch.full_like(log_r, -2.0)
    unit = torch.arange(turns).repeat_interleave(length)
    on = torch.ones_like(unit, dtype=torch.bool)
    _, stats = correction_weights("prod_tis", behavior + log_r, behavior, on, unit, 2.0, (0.5, 2.0))
    logged = correction_metrics(stats, paths=False)
    for key, expected in _closed_form(turn_kl).items():
        assert logged[f"correction/{key}"] == pytest.approx(expected, abs=0.03), key
    # the drift itself: the turns' Σ k3, over the turns, estimates D (E k3 = κ per token)
    assert stats["is_k3_sum"] / stats["is_units"] == pytest.approx(turn_kl, rel=0.03)


def test_the_default_correction_keeps_long_episodes_at_real_drift_near_one():
    # 60 turns of 150 tokens, each token's ratio 1 ± 1e-3 (a few versions of lag on a real model): the
    # async default must weigh every turn and every path within 5 % of 1. A product over the path would
    # not: its log weight Σ ±1e-3 over 9,000 tokens has sd 0.095, and this draw leaves [0.95, 1.05].
    cfg = load_config(overrides=["run.mode=async"])
    mode = cfg.algo.rollout_correction
    turns, length = 60, 150
    gen = torch.Generator().manual_seed(0)
    sign = torch.randint(0, 2, (turns * length,), generator=gen).double() * 2 - 1
    log_r = torch.log1p(sign * 1e-3)
    behavior = torch.full_like(log_r, -1.0)
    on = torch.ones(turns * length, dtype=torch.bool)
    turn = torch.arange(turns).repeat_interleave(length)
    for unit in (turn, torch.zeros_like(turn)):  # TreeOPSD's unit (the turn), the baselines' (the path)
        w, _ = correction_weights(
            mode, behavior + log_r, behavior, on, unit, cfg.algo.is_threshold, (0.5, 2.0)
        )
        per_turn = torch.zeros(turns, dtype=torch.float64).index_add(0, turn, w) / length
        assert float(per_turn.min()) >= 0.95 and float(per_turn.max()) <= 1.05
        assert 0.95 <= float(w.mean()) <= 1.05
    product, _ = correction_weights(
        "prod_tis", behavior + log_r, behavior, on, torch.zeros_like(turn), 2.0, (0.5, 2.0)
    )
    assert not 0.95 <= float(product[0]) <= 1.05  # the test would catch a product default


def test_drift_bounds_the_admitted_lag():
    # per-version drift d = turn KL / mean lag: 0.6 / 2 = 0.3; a bound of 0.5 allows ⌊0.5 / 0.3⌋ = 1 version
    assert drift_lag(4, 0.6, 2.0, 0.5) == 1
    assert drift_lag(4, 0.05, 1.0, 0.5) == 4  # ⌊10⌋ = 10, capped at eta
    assert drift_lag(4, 2.0, 1.0, 0.5) == 0  # even one version is too far: only the next batch's trees
    assert drift_lag(2, 0.0, 0.0, 0.5) == 2  # no drift measured: eta
    admission = Admission(eta=4, batch_size=8)
    assert admission.capacity(produced=0) == (4 + 0 + 1) * 8  # (η + v + 1)·B − produced = 40
    admission.limit_lag(drift_lag(4, 0.6, 2.0, 0.5))
    assert admission.capacity(produced=0) == (1 + 0 + 1) * 8  # 16: three versions fewer admitted
    admission.limit_lag(None)
    assert admission.capacity(produced=10) == 30


def test_drift_warns_once_per_level_naming_what_to_lower():
    warned: set[float] = set()
    assert drift_warning(0.2, warned) is None
    first = drift_warning(0.45, warned)
    assert (
        first is not None and "0.45 > 0.3" in first and "store.eta" in first and "store.max_turn_kl" in first
    )
    assert drift_warning(0.5, warned) is None  # 0.3 already said
    second = drift_warning(1.4, warned)
    assert second is not None and "> 1" in second
    assert drift_warning(3.0, warned) is None and warned == {0.3, 1.0}
