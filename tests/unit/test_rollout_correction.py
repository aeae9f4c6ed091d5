"""Rollout correction (learner/rollout_correction.py, docs/algorithm.md §11.1): every mode's weights on a
hand-worked example, and what the weights do inside each loss."""

from __future__ import annotations

import math

import pytest
import torch

from learner.baselines import gspo_loss, ppo_clip_loss
from learner.losses import treeopsd_loss
from learner.rollout_correction import correction_weights, mismatch_by_lag

F64 = torch.float64
# Seven tokens: units (sequences) 0 0 1 1 1, then one token off the loss and one with a NaN μ.
# Ratios r = π_prox/μ on the five: 3, 1 (unit 0: geometric mean √3 ≈ 1.732) and 1/4, 1, 4 (unit 1: ∛1 = 1).
RATIOS = [3.0, 1.0, 0.25, 1.0, 4.0, 7.0, 1.0]
UNIT = torch.tensor([0, 0, 1, 1, 1, -1, 1])
ON = torch.tensor([True, True, True, True, True, False, True])


def _weights(mode: str, threshold: float = 2.0, band: tuple[float, float] = (0.5, 2.0)):
    behavior = torch.tensor([-1.0] * 6 + [math.nan], dtype=F64)
    prox = behavior.nan_to_num(-1.0) + torch.tensor(RATIOS, dtype=F64).log()
    return correction_weights(mode, prox, behavior, ON, UNIT, threshold, band)


def test_none_weighs_every_counted_token_one():
    w, st = _weights("none")
    assert w.tolist() == [1, 1, 1, 1, 1, 0, 0]  # off the loss and NaN μ: 0, and not counted
    assert (st["is_tokens"], st["is_units"], st["is_weight_sum"]) == (5, 2, 5)


def test_token_tis_truncates_each_ratio_at_c():
    w, st = _weights("token_tis", threshold=2.0)
    assert w.tolist() == pytest.approx([2, 1, 0.25, 1, 2, 0, 0])  # min(r, 2)
    assert st["is_clipped_tokens"] == 2  # r = 3 and r = 4 exceed C
    assert st["is_weight_sum"] == pytest.approx(6.25) and st["is_weight_max"] == 2.0
    assert st["is_masked_tokens"] == 0


def test_geo_tis_gives_each_unit_its_geometric_mean():
    w, st = _weights("geo_tis", threshold=2.0)
    root3 = math.sqrt(3.0)  # exp(mean(log 3, log 1)); unit 1: exp((log ¼ + 0 + log 4)/3) = 1
    assert w.tolist() == pytest.approx([root3, root3, 1, 1, 1, 0, 0])
    assert st["is_clipped_tokens"] == 0
    w, st = _weights("geo_tis", threshold=1.5)  # √3 > 1.5: unit 0's two tokens are clipped to 1.5
    assert w.tolist() == pytest.approx([1.5, 1.5, 1, 1, 1, 0, 0]) and st["is_clipped_tokens"] == 2


def test_prod_tis_gives_each_unit_its_likelihood_ratio():
    # unit 0: 3 · 1 = 3; unit 1: ¼ · 1 · 4 = 1 (the NaN-μ token is not in it)
    w, st = _weights("prod_tis", threshold=5.0)
    assert w.tolist() == pytest.approx([3, 3, 1, 1, 1, 0, 0])
    assert st["is_clipped_tokens"] == 0 and st["is_log_ratio_max"] == pytest.approx(math.log(3.0))
    w, st = _weights("prod_tis", threshold=2.0)  # 3 > 2: unit 0's two tokens weigh C = 2
    assert w.tolist() == pytest.approx([2, 2, 1, 1, 1, 0, 0]) and st["is_clipped_tokens"] == 2


def test_prod_mis_drops_units_whose_ratio_exceeds_c():
    w, st = _weights("prod_mis", threshold=2.0)  # unit 0's ratio 3 > 2: dropped; unit 1 keeps its ratio 1
    assert w.tolist() == pytest.approx([0, 0, 1, 1, 1, 0, 0])
    assert (st["is_masked_tokens"], st["is_masked_units"], st["is_clipped_tokens"]) == (2, 1, 0)
    w, _ = _weights("prod_mis", threshold=4.0)  # 3 ≤ 4: kept at its ratio, not truncated
    assert w.tolist() == pytest.approx([3, 3, 1, 1, 1, 0, 0])


def test_token_mask_drops_tokens_outside_the_band():
    w, st = _weights("token_mask", band=(0.5, 2.0))
    assert w.tolist() == [0, 1, 0, 1, 0, 0, 0]  # 3, ¼ and 4 leave [0.5, 2]
    assert (st["is_masked_tokens"], st["is_masked_units"]) == (3, 0)  # each unit keeps one token
    w, st = _weights("token_mask", band=(0.9, 1.1))
    assert st["is_masked_tokens"] == 3


def test_geo_mask_drops_whole_units():
    w, st = _weights("geo_mask", band=(0.5, 1.5))  # unit 0's √3 ≈ 1.73 leaves the band, unit 1's 1 stays
    assert w.tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert (st["is_masked_tokens"], st["is_masked_units"]) == (2, 1)


def test_treeopsd_weights_make_a_weighted_mean_log_ratio():
    # One turn, 2 tokens, log π − log π_prox = (0.2, 0.4), q = ½, c = (2, 0). The weights are normalised in
    # the turn: m = Σ c = 2, s = (2·0.2 + 0·0.4) / 2 = 0.2; the turn weighs m in the sum and Z = ℓ = 2 (both
    # tokens are finite: a zero weight shrinks the step, it does not leave Z). L = 2 KL(½ ‖ σ(0.2)) / 2.
    ref = torch.zeros(2, dtype=F64)
    logp = torch.tensor([0.2, 0.4], dtype=F64, requires_grad=True)
    c = torch.tensor([2.0, 0.0], dtype=F64)
    loss, st = treeopsd_loss(logp, ref, torch.tensor([0, 0]), torch.tensor([0.5], dtype=F64), token_weights=c)
    sig = 1 / (1 + math.exp(-0.2))
    assert loss.item() == pytest.approx(
        0.5 * math.log(0.5 / sig) + 0.5 * math.log(0.5 / (1 - sig)), rel=1e-12
    )
    assert (st["num_tokens"], st["weight_mass"]) == (2.0, 2.0) and st["mean_abs_s"] == pytest.approx(0.2)
    loss.backward()
    # dL/dlogp_t = m · (σ(s) − q) · (c_t / m) / Z = c_t (σ(s) − q) / Z = (2 (σ(0.2) − ½) / 2, 0)
    assert logp.grad.tolist() == pytest.approx([sig - 0.5, 0.0], rel=1e-12)


def test_ppo_clip_multiplies_each_tokens_objective():
    # Ratio 1 (logp = old), A = (1, −1): unweighted L = −(1 − 1)/2 = 0. Weights (2, ½):
    # L = −(2·1 + ½·(−1))/2 = −0.75. Weights (0, 1): the first token leaves, Z stays 2: L = −(−1)/2 = 0.5.
    logp = torch.zeros(2, dtype=F64)
    adv, mask = torch.tensor([1.0, -1.0], dtype=F64), torch.tensor([True, True])
    w = torch.tensor([2.0, 0.5], dtype=F64)
    loss, _ = ppo_clip_loss(logp, logp, adv, mask, 0.2, 0.2, is_weights=w)
    assert loss.item() == pytest.approx(-0.75)
    loss, st = ppo_clip_loss(logp, logp, adv, mask, 0.2, 0.2, is_weights=torch.tensor([0.0, 1.0], dtype=F64))
    assert loss.item() == pytest.approx(0.5) and st["num_tokens"] == 1.0


def test_gspo_weighs_each_sequence_by_its_tokens_mean_weight():
    # Two sequences, ratio 1, A = (1, 2); token weights (2, 2 | 1, 0): sequence 0 weight 2, sequence 1 keeps
    # one token of weight 1. |B| = 2 (fixed before the mask): L = −(2·1 + 1·2)/2 = −2.
    logp = torch.zeros(4, dtype=F64)
    w = torch.tensor([2.0, 2.0, 1.0, 0.0], dtype=F64)
    seq = torch.tensor([0, 0, 1, 1])
    loss, st = gspo_loss(logp, logp, torch.tensor([1.0, 2.0], dtype=F64), seq, is_weights=w)
    assert loss.item() == pytest.approx(-2.0) and st["num_seqs"] == 2.0


def test_mismatch_by_lag_sums_k1_and_k3_per_lag():
    # log r = log π_prox − log μ: lag 0 tokens (0.1, −0.1), lag 2 token (0.5).
    # k1 = −log r: lag 0 sums to 0; lag 2: −0.5. k3 = e^{log r} − 1 − log r.
    d = torch.tensor([0.1, -0.1, 0.5], dtype=F64)
    out = mismatch_by_lag(d, torch.zeros(3, dtype=F64), torch.tensor([True] * 3), torch.tensor([0, 0, 2]))
    k3 = [math.exp(x) - 1 - x for x in (0.1, -0.1, 0.5)]
    assert out[0][0] == pytest.approx(0.0, abs=1e-15) and out[0][1] == pytest.approx(k3[0] + k3[1])
    assert out[0][2] == 2 and out[2] == pytest.approx((-0.5, k3[2], 1))
