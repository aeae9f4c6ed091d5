"""Hand-worked values for learner.losses / learner.baselines (docs/algorithm.md §5, §8, §10).

Arithmetic is in the comments; σ = sigmoid, logσ = logsigmoid. Everything float64 unless the test is about
dtypes.
"""

import math

import numpy as np
import pytest
import torch

from learner.losses import (
    grpo_advantages,
    grpo_loss,
    gspo_loss,
    masked_whiten,
    pg_surrogate_loss,
    ppo_clip_loss,
    treeopsd_advantages,
    treeopsd_loss,
    treepo_advantages,
    treepo_loss,
)

F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def logit(p):
    return math.log(p) - math.log1p(-p)


def two_turn_example():
    # Tokens [a, a, b]: turn 0 has 2 tokens, turn 1 has 1 token; logp − behavior = [0.2, 0.0, −0.1].
    behavior = t([-1.0, -2.0, -0.5])
    logp = (behavior + t([0.2, 0.0, -0.1])).requires_grad_(True)
    turn_ids = torch.tensor([0, 0, 1])
    q = t([0.6, 0.45])
    return logp, behavior, turn_ids, q


# --------------------------------------------------------------------------------------------- TreeOPSD


def test_two_turns_hand_worked_value_and_stats():
    logp, behavior, turn_ids, q = two_turn_example()
    loss, stats = treeopsd_loss(logp, behavior, turn_ids, q)
    # s_0 = (0.2 + 0.0)/2 = 0.1, s_1 = −0.1/1 = −0.1.
    # logσ(0.1) = −0.6443966600735709, logσ(−0.1) = −0.7443966600735710
    # KL_0 = 0.6 log 0.6 + 0.4 log 0.4 − 0.6 logσ(0.1) − 0.4 logσ(−0.1)
    #      = −0.3064953743 − 0.3665162927 + 0.3866379960 + 0.2977586640 = 0.0113849931
    # KL_1 = 0.45 log 0.45 + 0.55 log 0.55 − 0.45 logσ(−0.1) − 0.55 logσ(0.1)
    #      = −0.3593284633 − 0.3288103504 + 0.3349784970 + 0.3544181630 = 0.0012578464
    # loss = (2·KL_0 + 1·KL_1)/3 = (0.0227699861 + 0.0012578464)/3 = 0.0080092775
    kl0, kl1 = 0.011384993064314397, 0.0012578463599825507
    assert loss.dtype == F64
    assert loss.item() == pytest.approx((2 * kl0 + kl1) / 3, abs=1e-15)
    assert loss.item() == pytest.approx(0.008009277496203782, abs=1e-15)
    assert stats["mean_abs_s"] == pytest.approx(0.1)
    assert stats["max_abs_s"] == pytest.approx(0.1)
    assert stats["kl_to_target"] == pytest.approx(loss.item())
    # logit(0.6) = 0.405 > s_0 = 0.1 > 0 and logit(0.45) = −0.201 < s_1 = −0.1 < 0: both short of target.
    assert stats["overshoot_frac"] == 0.0
    assert (stats["num_turns"], stats["num_tokens"], stats["nonfinite_tokens"]) == (2, 3, 0)
    assert all(isinstance(v, float) for v in stats.values())


def test_two_turns_gradient_is_sigma_minus_q():
    logp, behavior, turn_ids, q = two_turn_example()
    loss, _ = treeopsd_loss(logp, behavior, turn_ids, q)
    loss.backward()
    # dL/dlogp_t = ℓ_i (σ(s_i) − q_i)/Z · (1/ℓ_i) = (σ(s_i) − q_i)/Z,  Z = 3.
    # σ(0.1) = 0.52497918747894 → (0.52497918747894 − 0.6)/3 = −0.02500693750702
    # σ(−0.1) = 0.47502081252106 → (0.47502081252106 − 0.45)/3 = +0.00834027084035
    expected = t([-0.02500693750702, -0.02500693750702, 0.00834027084035])
    torch.testing.assert_close(logp.grad, expected, atol=1e-13, rtol=0)


def test_gradient_wrt_s_equals_residual_on_a_grid():
    # One turn of one token, so s = logp − behavior and dL/ds = σ(s) − q exactly (ℓ = Z = 1).
    for qv in (0.0, 0.1, 0.45, 0.5, 0.9, 1.0):
        for sv in (-3.0, -0.4, 0.0, 0.7, 5.0):
            s = t([sv]).requires_grad_(True)
            loss, _ = treeopsd_loss(s, t([0.0]), torch.tensor([0]), t([qv]))
            loss.backward()
            assert s.grad.item() == pytest.approx(1 / (1 + math.exp(-sv)) - qv, abs=1e-15)


@pytest.mark.parametrize("qv", [0.05, 0.3, 0.5, 0.62, 0.99])
def test_zero_at_target(qv):
    # s = logit(q) = log r*: the loss is 0 up to rounding (and never negative); with logits it is exactly 0.
    s_star = logit(qv)
    loss, stats = treeopsd_loss(t([s_star, s_star]), t([0.0, 0.0]), torch.tensor([0, 0]), t([qv]))
    assert 0.0 <= loss.item() < 1e-15
    assert stats["overshoot_frac"] == 0.0
    loss_l, _ = treeopsd_loss(t([s_star]), t([0.0]), torch.tensor([0]), t([s_star]), teacher_logits=True)
    assert loss_l.item() == 0.0


def test_q_half_and_s_zero_gives_exact_zero_loss_and_gradient():
    # KL = 0.5 log 0.5 + 0.5 log 0.5 − 0.5 logσ(0) − 0.5 logσ(0) = log ½ − log ½ = 0 exactly; σ(0) − ½ = 0.
    logp = t([-1.3, -0.2]).requires_grad_(True)
    loss, stats = treeopsd_loss(logp, logp.detach(), torch.tensor([0, 0]), t([0.5]))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros(2, dtype=F64))
    assert stats["overshoot_frac"] == 0.0  # q = ½ and s = 0: not overshot


def test_teacher_logits_matches_probabilities():
    logp, behavior, turn_ids, q = two_turn_example()
    loss_p, stats_p = treeopsd_loss(logp, behavior, turn_ids, q)
    u = torch.log(q) - torch.log1p(-q)  # log r*
    loss_u, stats_u = treeopsd_loss(logp, behavior, turn_ids, u, teacher_logits=True)
    assert loss_u.item() == pytest.approx(loss_p.item(), abs=1e-15)
    assert stats_u == pytest.approx(stats_p)


def test_q_at_zero_and_one_is_finite():
    # q = 1, s = 0: KL = 1·log 1 + 0·log 0 − logσ(0) − 0 = log 2 (xlogy: 0·log 0 = 0).
    # q = 0, s = 0: symmetric, log 2.  loss = (log 2 + log 2)/2 = log 2.
    loss, _ = treeopsd_loss(t([0.0, 0.0]), t([0.0, 0.0]), torch.tensor([0, 1]), t([1.0, 0.0]))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-15)


def test_overshoot_definition():
    # Turn 0: q = 0.6, s* = 0.405, s = 0.5 > s*: residual σ(0.5) − 0.6 = +0.022 vs −0.1 at s = 0 → overshot.
    # Turn 1: q = 0.45, s* = −0.201, s = +0.1: residual +0.075 vs +0.05 at s = 0 → same sign, not overshot.
    # Turn 2: q = 0.5, s = −0.3 ≠ 0 → overshot by definition.  Turn 3: q = 0.5, s = 0 → not overshot.
    s = t([0.5, 0.1, -0.3, 0.0])
    _, stats = treeopsd_loss(s, torch.zeros(4, dtype=F64), torch.arange(4), t([0.6, 0.45, 0.5, 0.5]))
    assert stats["overshoot_frac"] == pytest.approx(2 / 4)


def test_zero_length_turns_are_excluded_from_z():
    # Turn 1 has no tokens (its q is NaN and must never be read); turn 2's only token is masked (−1).
    # Only turn 0 counts: s = 0.3, Z = ℓ_0 = 2, loss = 2·KL(0.7 || σ(0.3))/2.
    q = t([0.7, float("nan"), 0.2])
    loss, stats = treeopsd_loss(t([0.3, 0.3, 9.0]), t([0.0, 0.0, 0.0]), torch.tensor([0, 0, -1]), q)
    kl = 0.7 * math.log(0.7) + 0.3 * math.log(0.3) + 0.7 * math.log1p(math.exp(-0.3))
    kl += 0.3 * math.log1p(math.exp(0.3))
    assert loss.item() == pytest.approx(kl, abs=1e-15)
    assert (stats["num_turns"], stats["num_tokens"]) == (1, 2)


def test_nonfinite_tokens_are_dropped_and_counted():
    # Turn 0: tokens [0.2, NaN, 0.0] → dropped NaN: s_0 = 0.1, ℓ_0 = 2 (same as the clean example).
    # Turn 1: [−0.1] plus a token whose behavior log-prob is −inf → s_1 = −0.1, ℓ_1 = 1.
    # Turn 2: every token non-finite → ℓ_2 = 0, weight 0, excluded.
    # An env token (turn −1) holding NaN is not counted.
    nan, inf = float("nan"), float("inf")
    behavior = t([0.0, 0.0, 0.0, 0.0, -inf, 0.0, 0.0, 0.0])
    logp = t([0.2, nan, 0.0, -0.1, -1.0, nan, inf, nan]).requires_grad_(True)
    turn_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, -1])
    loss, stats = treeopsd_loss(logp, behavior, turn_ids, t([0.6, 0.45, 0.9]))
    assert loss.item() == pytest.approx(0.008009277496203782, abs=1e-15)
    assert stats["nonfinite_tokens"] == 4 and stats["nonfinite_turns"] == 3
    assert (stats["num_turns"], stats["num_tokens"]) == (2, 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[[1, 4, 5, 6, 7]], torch.zeros(5, dtype=F64))


def test_no_loss_tokens_gives_zero_loss_with_working_backward():
    logp = t([-1.0, float("nan"), -2.0]).requires_grad_(True)
    loss, stats = treeopsd_loss(logp, t([-1.0, -1.0, -1.0]), torch.tensor([-1, -1, -1]), t([0.7, 0.2]))
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(3, dtype=F64))
    assert stats["num_turns"] == 0 and stats["num_tokens"] == 0 and stats["kl_to_target"] == 0.0
    # Also with no turns at all, and for an empty token stream.
    loss, _ = treeopsd_loss(logp, t([-1.0, -1.0, -1.0]), torch.tensor([-1, -1, -1]), t([]))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(3, dtype=F64))
    empty = torch.zeros(0, dtype=F64, requires_grad=True)
    loss, _ = treeopsd_loss(empty, torch.zeros(0, dtype=F64), torch.zeros(0, dtype=torch.long), t([0.5]))
    loss.backward()
    assert loss.item() == 0.0


def test_large_finite_s_is_finite():
    # q = 0.6, s = +50: KL = 0.6 log 0.6 + 0.4 log 0.4 − 0.6 logσ(50) − 0.4 logσ(−50)
    #                      ≈ −0.6730116670 + 0 + 0.4·50 = 19.326988333;  gradient σ(50) − 0.6 = 0.4.
    # q = 0.6, s = −50: ≈ −0.6730116670 + 0.6·50 = 29.326988333;        gradient σ(−50) − 0.6 = −0.6.
    for sv, expected, grad in ((50.0, 19.326988333, 0.4), (-50.0, 29.326988333, -0.6)):
        s = t([sv]).requires_grad_(True)
        loss, _ = treeopsd_loss(s, t([0.0]), torch.tensor([0]), t([0.6]))
        loss.backward()
        assert loss.item() == pytest.approx(expected, abs=1e-8)
        assert s.grad.item() == pytest.approx(grad, abs=1e-12)
    s32 = torch.tensor([60.0, -60.0], requires_grad=True)
    loss, stats = treeopsd_loss(s32, torch.zeros(2), torch.tensor([0, 1]), torch.tensor([0.3, 0.7]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(s32.grad).all() and stats["max_abs_s"] == 60.0


def test_compute_dtype():
    logp, behavior, turn_ids, q = two_turn_example()
    l64, _ = treeopsd_loss(logp, behavior, turn_ids, q)
    for dt in (torch.float32, torch.bfloat16):
        lp = logp.detach().to(dt).requires_grad_(True)
        loss, _ = treeopsd_loss(lp, behavior.to(dt), turn_ids, q.float())
        assert loss.dtype == torch.float32  # bf16 is upcast; float32 stays float32
        loss.backward()
        assert lp.grad.dtype == dt
    l32, _ = treeopsd_loss(logp.detach().float(), behavior.float(), turn_ids, q.float())
    assert l32.item() == pytest.approx(l64.item(), rel=1e-5)


def test_z_total_overrides_normalizer():
    # Local Σ ℓ KL = 3 · 0.0080092775; with a global Z = 12 the loss is 3/12 of the local token-mean.
    logp, behavior, turn_ids, q = two_turn_example()
    loss, stats = treeopsd_loss(logp, behavior, turn_ids, q, z_total=12.0)
    assert loss.item() == pytest.approx(0.008009277496203782 * 3 / 12, abs=1e-15)
    assert stats["kl_to_target"] == pytest.approx(0.008009277496203782)
    with pytest.raises(ValueError, match=r"^z_total must be > 0 when there are loss tokens, got 0\.0$"):
        treeopsd_loss(logp, behavior, turn_ids, q, z_total=0.0)


def test_invalid_inputs_raise():
    logp, behavior, turn_ids, q = two_turn_example()
    with pytest.raises(ValueError, match=r"^q must lie in \[0, 1\] for every turn with loss tokens$"):
        treeopsd_loss(logp, behavior, turn_ids, t([0.6, 1.2]))
    with pytest.raises(ValueError, match=r"^turn_ids reach 2 but q has only 2 turns$"):
        treeopsd_loss(logp, behavior, torch.tensor([0, 0, 2]), q)
    with pytest.raises(ValueError, match=r"^logp \(3,\), behavior_logp \(2,\) and turn_ids \(3,\) must all"):
        treeopsd_loss(logp, behavior[:2], turn_ids, q)


def test_advantage_form_hand_worked():
    logp, behavior, turn_ids, q = two_turn_example()
    adv = treeopsd_advantages(logp, behavior, turn_ids, q)
    # Â = q − σ(s): 0.6 − 0.52497918747894 = 0.07502081252106; 0.45 − 0.47502081252106 = −0.02502081252106
    torch.testing.assert_close(adv, t([0.07502081252106, 0.07502081252106, -0.02502081252106]))
    assert not adv.requires_grad
    loss, stats = treeopsd_loss(logp, behavior, turn_ids, q)
    (g_kl,) = torch.autograd.grad(loss, logp)
    pg, pg_stats = pg_surrogate_loss(logp, turn_ids, adv, stats["num_tokens"])
    (g_pg,) = torch.autograd.grad(pg, logp)
    torch.testing.assert_close(g_pg, g_kl, atol=1e-15, rtol=0)
    # logp = [−0.8, −2.0, −0.6]:  −(1/3)(0.0750208125·(−0.8) + 0.0750208125·(−2.0) + (−0.0250208125)·(−0.6))
    #   = −(1/3)(−0.0600166500 − 0.1500416250 + 0.0150124875) = 0.0650152625
    assert pg.item() == pytest.approx(0.065015262515444, abs=1e-12)
    assert pg_stats["num_tokens"] == 3
    # A boolean mask instead of turn ids gives the same surrogate.
    pg_m, _ = pg_surrogate_loss(logp, turn_ids >= 0, adv, 3)
    assert pg_m.item() == pg.item()


# --------------------------------------------------------------------------------------------- GRPO


def test_grpo_advantages_hand_worked():
    # Group 7: R = [1, 0, 0, 1], mean ½, sd₁ = sqrt(4·¼/3) = 0.5773502692 → A = ±0.5/(0.5773502692 + 1e-6)
    # Group 3: R = [1, 1], sd₁ = 0 → 0.   Group 9: a single trajectory → 0.
    rewards = t([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.4])
    groups = torch.tensor([7, 7, 3, 7, 7, 3, 9])
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # 0.8660239...
    torch.testing.assert_close(grpo_advantages(rewards, groups), t([a, -a, 0.0, -a, a, 0.0, 0.0]))


def test_grpo_loss_clipping_hand_worked():
    # ratio κ = [1.5, 1.5, 0.5, 0.5], A = [+1, −1, +1, −1], ε = 0.2:
    #   κ=1.5, A=+1: min(1.5, 1.2)   = 1.2  (clipped)     κ=1.5, A=−1: min(−1.5, −1.2) = −1.5 (unclipped)
    #   κ=0.5, A=+1: min(0.5, 0.8)   = 0.5  (unclipped)   κ=0.5, A=−1: min(−0.5, −0.8) = −0.8 (clipped)
    # A 5th, masked token holds NaN and is ignored.  L = −(1.2 − 1.5 + 0.5 − 0.8)/4 = 0.15
    old = t([-1.0, -1.0, -1.0, -1.0, 0.0])
    logp = (old + torch.log(t([1.5, 1.5, 0.5, 0.5, 1.0]))).detach()
    logp[4] = float("nan")
    logp.requires_grad_(True)
    adv = t([1.0, -1.0, 1.0, -1.0, 5.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    loss, stats = grpo_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(0.15, abs=1e-14)
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["ratio_mean"] == pytest.approx(1.0)
    # k3 = κ − 1 − log κ: 0.5 − log 1.5 = 0.0945348919, −0.5 + log 2 = 0.1931471806; mean = 0.1438410362
    assert stats["approx_kl"] == pytest.approx(0.1438410362, abs=1e-9)
    loss.backward()
    # Clipped tokens have zero gradient; unclipped: d(−κA/Z)/dlogp = −κA/4 → +0.375 and −0.125.
    torch.testing.assert_close(logp.grad, t([0.0, 0.375, -0.125, 0.0, 0.0]), atol=1e-14, rtol=0)


def test_grpo_gradient_at_ratio_one_is_minus_a_over_z():
    logp = t([-0.3, -2.0, -1.1]).requires_grad_(True)
    adv = t([0.7, -1.2, 0.4])
    loss, stats = grpo_loss(logp, logp.detach(), adv, torch.ones(3))
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 3, atol=1e-15, rtol=0)
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == 0.0


def test_treepo_loss_uses_clip_higher():
    # κ = 1.5, A = +1 → clipped at 1 + 0.28 = 1.28 (vs 1.2 in GRPO); κ = 0.5, A = −1 → clipped at −0.8.
    logp = torch.log(t([1.5, 0.5]))
    loss, stats = treepo_loss(logp, t([0.0, 0.0]), t([1.0, -1.0]), torch.ones(2))
    assert loss.item() == pytest.approx(-(1.28 - 0.8) / 2, abs=1e-14)
    assert stats["clip_frac"] == 1.0


# --------------------------------------------------------------------------------------------- GSPO


def test_gspo_hand_worked():
    # Seq 0: token log-ratios [0.001, 0.0002] → mean 0.0006, s_0 = e^0.0006 = 1.00060018 > 1 + 4e-4;
    #        A_0 = +1 → min(1.00060018, 1.0004) = 1.0004 (clipped).
    # Seq 1: one token, log-ratio −0.001, s_1 = 0.99900050 < 1 − 3e-4; A_1 = +2
    #        → min(1.99800100, 2·0.9997) = 1.99800100 (unclipped).
    # An env token (seq −1) with NaN is ignored.  L = −(1.0004 + 1.99800100)/2 = −1.49920050
    old = t([-1.0, -2.0, -0.5, 0.0])
    logp = (old + t([0.001, 0.0002, -0.001, float("nan")])).requires_grad_(True)
    loss, stats = gspo_loss(logp, old, t([1.0, 2.0]), torch.tensor([0, 0, 1, -1]))
    s1 = math.exp(-0.001)
    assert loss.item() == pytest.approx(-(1.0004 + 2 * s1) / 2, abs=1e-14)
    assert stats["clip_frac"] == 0.5 and stats["num_seqs"] == 2
    loss.backward()
    # Only seq 1 has a gradient: d(−s_1 A_1/2)/dlogp = −s_1·2/2 = −0.99900050.
    torch.testing.assert_close(logp.grad, t([0.0, 0.0, -s1, 0.0]), atol=1e-14, rtol=0)
    # No sequence in the loss: zero loss, backward still works.
    loss, stats = gspo_loss(logp, old, t([]), torch.tensor([-1, -1, -1, -1]))
    loss.backward()
    assert loss.item() == 0.0 and stats["num_seqs"] == 0


def test_gspo_one_token_per_sequence_equals_token_level_clip():
    # With one token per sequence, s_j = κ_j and sequence-mean = token-mean, so GSPO == token PPO-clip.
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(64, generator=gen, dtype=F64) * 3
    logp = (old + (torch.rand(64, generator=gen, dtype=F64) - 0.5) * 2e-3).requires_grad_(True)
    adv = torch.randn(64, generator=gen, dtype=F64)
    l_seq, st_seq = gspo_loss(logp, old, adv, torch.arange(64))
    l_tok, st_tok = ppo_clip_loss(logp, old, adv, torch.ones(64), 3e-4, 4e-4)
    (g_seq,) = torch.autograd.grad(l_seq, logp)
    (g_tok,) = torch.autograd.grad(l_tok, logp)
    assert l_seq.item() == pytest.approx(l_tok.item(), abs=1e-15)
    torch.testing.assert_close(g_seq, g_tok, atol=1e-15, rtol=0)
    assert 0.1 < st_seq["clip_frac"] == st_tok["clip_frac"] < 0.9


# --------------------------------------------------------------------------------------------- TreePO


def test_treepo_advantages_hand_worked():
    # root ─┬─ 0 ── 2 ─┬─ 3 (leaf, R = 1)
    #       │          └─ 4 (leaf, R = 0)
    #       └─ 1 ── 5 (leaf, R = 0)
    # Root group (d = 0): all leaves {3, 4, 5}, mean 1/3.
    # Leaf 3, path [0, 2, 3]: d=0: 1 − 1/3 = 2/3; d=1 (under 0: {3,4}, mean ½): ½; d=2 (under 2: the same
    #   {3,4} again, counted again): ½.  Â_3 = (2/3 + ½ + ½)/3 = 5/9.
    # Leaf 4: d=0: −1/3; d=1: −½; d=2: −½.  Â_4 = (−1/3 − 1)/3 = −4/9.
    # Leaf 5, path [1, 5]: d=0: −1/3; d=1 (under 1: {5}, size 1) excluded.  Â_5 = −1/3.
    parents = [-1, -1, 0, 2, 2, 1]
    leaves, adv = treepo_advantages(parents, [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(leaves, [3, 4, 5])
    np.testing.assert_allclose(adv, [5 / 9, -4 / 9, -1 / 3], rtol=0, atol=1e-15)
    # Rewards given per node (only the leaf entries are read) give the same answer.
    _, adv_nodes = treepo_advantages(np.array(parents), [9.0, 9.0, 9.0, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(adv_nodes, adv, rtol=0, atol=1e-15)


def test_treepo_advantages_flat_and_constant():
    # Four independent one-turn leaves: only d = 0 → Â = R − mean = [1, 0, 0, 0] − ¼.
    _, adv = treepo_advantages([-1, -1, -1, -1], [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(adv, [0.75, -0.25, -0.25, -0.25], atol=1e-15)
    # Equal rewards: every group mean equals R, so Â ≡ 0.
    _, adv = treepo_advantages([-1, 0, 0, -1, 3], [0.5, 0.5, 0.5])
    np.testing.assert_allclose(adv, 0.0, atol=1e-15)
    with pytest.raises(ValueError, match=r"^leaf_rewards has 1 entries; expected 2 leaves or 3 nodes$"):
        treepo_advantages([-1, 0, 0], [1.0])


def test_masked_whiten():
    # Masked values [1, 2, 3]: mean 2, unbiased var ((−1)² + 0 + 1²)/2 = 1 → [−1, 0, 1]; masked-out → 0.
    out = masked_whiten(t([1.0, 100.0, 2.0, 3.0]), torch.tensor([1, 0, 1, 1]))
    torch.testing.assert_close(out, t([-1.0, 0.0, 0.0, 1.0]), atol=1e-7, rtol=0)
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(6, 40, generator=gen, dtype=F64) * 3 + 7
    m = torch.rand(6, 40, generator=gen) < 0.6
    w = masked_whiten(v, m)[m]
    assert abs(w.mean().item()) < 1e-12
    assert w.std().item() == pytest.approx(1.0, abs=1e-8)
