"""TreeOPSD off-policy by exact expectation (docs/algorithm.md §11.1): every turn a 3-token vocabulary can
produce, enumerated, so that E_μ[·] and E_π_prox[·] are sums, not samples.

The setting: one turn of L = 2..4 tokens after a fixed history, an autoregressive tabular policy (logits per
position and previous token), the behavior policy μ ≠ π_prox, and a teacher q(y) that depends on the whole
turn y (action-dependent credit, as V_i is). The target is the on-policy gradient of π_prox: with μ = π_prox
the turn's term at θ = π_prox is (½ − q(y)) Σ_t ∇log π(y_t | y_<t) / Z, so

    g_on = Σ_y π_prox(y) (½ − q(y)) Σ_t ∇log π(y_t | y_<t) / Z.

A mode is unbiased when Σ_y μ(y) ∇L_mode(y) = g_on. Only the turn's product ratio Π_t π_prox/μ is the
likelihood ratio of what q depends on; a token weight r_t fixes token t's own distribution but not the
tokens after it, whose draw from μ shaped q(y) too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from learner.losses import treeopsd_loss
from learner.rollout_correction import correction_weights

F64 = torch.float64
VOCAB = 3
NO_TRUNCATION = 1e12  # C above every ratio: the untruncated weight


def _table(seed: int, length: int, scale: float) -> torch.Tensor:
    """Logits [L, VOCAB + 1, VOCAB]: position t, previous token (index VOCAB = none yet), next token."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(length, VOCAB + 1, VOCAB, dtype=F64, generator=gen) * scale


def _token_logp(table: torch.Tensor, turn: tuple[int, ...]) -> torch.Tensor:
    """[L] log π(y_t | y_<t) of the turn under the tabular policy."""
    prev = (VOCAB, *turn[:-1])
    return torch.stack([torch.log_softmax(table[t, prev[t]], -1)[y] for t, y in enumerate(turn)])


def _teacher(length: int, seed: int) -> dict[tuple[int, ...], float]:
    """q(y) ∈ (0.15, 0.85) per whole turn: credit that depends on every token of it."""
    gen = torch.Generator().manual_seed(seed)
    turns = list(itertools.product(range(VOCAB), repeat=length))
    q = 0.15 + 0.7 * torch.rand(len(turns), dtype=F64, generator=gen)
    return dict(zip(turns, q.tolist(), strict=True))


def _expected_gradient(theta, mu_table, q_of, mode, length) -> torch.Tensor:
    """Σ_y μ(y) ∇_θ L_mode(y) at θ = π_prox (mode None: the on-policy sample, μ := π_prox, no weights)."""
    total = torch.zeros_like(theta)
    for turn, q in q_of.items():
        logp = _token_logp(theta, turn)
        prox = logp.detach()
        behavior = prox if mode is None else _token_logp(mu_table, turn)
        ids = torch.zeros(length, dtype=torch.long)
        c = None
        if mode is not None:
            c, _ = correction_weights(mode, prox, behavior, ids >= 0, ids, NO_TRUNCATION, (0.5, 2.0))
        loss, _ = treeopsd_loss(
            logp, prox, ids, torch.tensor([q], dtype=F64), z_total=length, token_weights=c
        )
        (grad,) = torch.autograd.grad(loss, theta)
        total += behavior.sum().exp() * grad  # the sample's probability under the policy that drew it
    return total


def _setting(length: int):
    theta = _table(1, length, 1.0).requires_grad_()
    mu_table = theta.detach() + _table(2, length, 0.7)  # a stale sampler: every conditional moved
    return theta, mu_table, _teacher(length, seed=3)


@pytest.mark.parametrize("length", [2, 3, 4])
@pytest.mark.parametrize("mode", ["prod_tis", "prod_mis"])
def test_turn_product_weight_gives_the_on_policy_gradient_of_pi_prox(length, mode):
    # Today's code fails this: it has no turn-level weight (`prod_tis` / `prod_mis` are unknown modes).
    # Untruncated, Σ_y μ(y) (π_prox(y)/μ(y)) ∇L(y) = Σ_y π_prox(y) ∇L(y) term by term: equal to rounding.
    theta, mu_table, q_of = _setting(length)
    on_policy = _expected_gradient(theta, mu_table, q_of, None, length)
    corrected = _expected_gradient(theta, mu_table, q_of, mode, length)
    assert float(on_policy.abs().max()) > 1e-3  # a gradient worth matching
    # measured: relative error 2.5e-16 (L = 2, 3), 6.6e-16 (L = 4)
    assert float((corrected - on_policy).norm()) <= 1e-12 * float(on_policy.norm())


@pytest.mark.parametrize("length", [2, 3, 4])
def test_token_weights_and_no_weights_leave_a_bias_on_multi_token_turns(length):
    # The defect the product weight fixes, measured: per-token ratios (token_tis untruncated) and no weight
    # (none) both miss g_on by a clear margin once a turn has two tokens or more. Relative bias
    # ‖E_μ g − g_on‖ / ‖g_on‖ at these tables, measured: token_tis 0.073, 0.61, 0.75 and none 0.17, 0.93,
    # 1.60 for L = 2, 3, 4; the product weight's is below 1e-15.
    theta, mu_table, q_of = _setting(length)
    on_policy = _expected_gradient(theta, mu_table, q_of, None, length)
    scale = float(on_policy.norm())
    for mode in ("token_tis", "none"):
        biased = _expected_gradient(theta, mu_table, q_of, mode, length)
        assert float((biased - on_policy).norm()) / scale > 0.05, mode


def test_one_token_turns_are_unbiased_under_token_weights_too():
    # With L = 1 the token ratio *is* the turn's ratio: token_tis and prod_tis coincide and are exact.
    theta, mu_table, q_of = _setting(1)
    on_policy = _expected_gradient(theta, mu_table, q_of, None, 1)
    for mode in ("token_tis", "prod_tis"):
        corrected = _expected_gradient(theta, mu_table, q_of, mode, 1)
        assert float((corrected - on_policy).abs().max()) <= 1e-12


@pytest.mark.parametrize("weights", [(2.0, 0.5, 1.0), (1.7, 1.7, 1.7), (0.3, 1.2, 0.0)])
def test_turn_minimum_stays_at_log_r_star_under_weights(weights):
    # Today's code fails this: s_i = (1/ℓ_i) Σ c_t d_t stops the loss where the turn's log-ratio is
    # log r* / c̄ (c̄ = the mean kept weight: 1.1667, 1.7, 0.75 here), not log r*.
    # Move every token's log-ratio by the same d (log π = log π_prox + d): the loss of the turn, as a function
    # of d, must be minimal at d = log r* = logit(q), where its derivative vanishes.
    q = 0.8
    log_r_star = torch.log(torch.tensor(q / (1 - q), dtype=F64))
    c = torch.tensor(weights, dtype=F64)
    prox = torch.tensor([-1.0, -2.0, -0.5], dtype=F64)
    ids = torch.zeros(3, dtype=torch.long)

    def loss_at(d: torch.Tensor) -> torch.Tensor:
        loss, _ = treeopsd_loss(prox + d, prox, ids, torch.tensor([q], dtype=F64), token_weights=c)
        return loss

    d = log_r_star.clone().requires_grad_()
    (slope,) = torch.autograd.grad(loss_at(d), d)
    assert abs(float(slope)) <= 1e-12
    assert float(loss_at(log_r_star)) <= 1e-15  # KL(q ‖ σ(log r*)) = 0
    for off in (-0.1, 0.1):  # and it is a minimum: the loss is larger on either side
        assert float(loss_at(log_r_star + off)) > 1e-6
