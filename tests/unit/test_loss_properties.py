"""Property checks of the TreeOPSD loss on random initialize–expand trees (docs/algorithm.md §6, §7.3–§7.5).

Policy: a tabular softmax, log π(y | h) = log_softmax(θ[bucket(h)])[y], with θ ∈ R^{buckets × 6}. Buckets are
shared across turns and trees (so updates interact, as in a real model), except in §7.4 where every token
gets a private bucket. Trees come from tests/treegen.py, credit from system.credit.credit_tree
(z with ddof = 1 → uniform backup V → τ = (K−1)/(ρ√K) → q = 1/2 + V/τ). Each turn contributes its ℓ_i model
tokens; every non-terminal turn is followed by observation tokens (turn id −1), and some turns have ℓ_i = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from treegen import GenTree, random_rewards, random_tree, tree_strategy

from learner.losses import grpo_loss, pg_surrogate_loss, treeopsd_advantages, treeopsd_loss
from learner.rollout_correction import correction_weights
from system.credit import credit_tree

F64 = torch.float64
VOCAB = 6
BUCKETS = 97
OBS_TOKENS = 2


@dataclass
class Batch:
    bucket: torch.Tensor  # [T] long, context bucket of each token
    token: torch.Tensor  # [T] long, sampled token id
    turn_ids: torch.Tensor  # [T] long, global turn index or −1 (observation tokens)
    q: torch.Tensor  # [n] teacher
    coef: torch.Tensor  # [n] V_i/τ of the turn's tree (0 when τ is undefined)
    V: torch.Tensor  # [n] backed-up credit
    tree: torch.Tensor  # [n] tree index of each turn
    ell: torch.Tensor  # [n] model tokens per turn

    @property
    def n_buckets(self) -> int:
        return int(self.bucket.max()) + 1


def pack_trees(
    trees: list[GenTree], rng: np.random.Generator, rho: float, kinds=("binary", "uniform", "one_success")
) -> Batch:
    buckets, tokens, turn_ids, q, coef, v, tree_of, ell = [], [], [], [], [], [], [], []
    offset = 0
    for k, tr in enumerate(trees):
        credit = credit_tree(tr.parents, random_rewards(rng, tr.leaf, kinds[k % len(kinds)]), rho)
        inv_tau = 0.0 if credit.tau is None else 1.0 / credit.tau
        for i in range(tr.num_nodes):
            n_tok = int(tr.turn_lengths[i]) + (0 if tr.leaf[i] else OBS_TOKENS)
            buckets.append(rng.integers(0, BUCKETS, size=n_tok))
            tokens.append(rng.integers(0, VOCAB, size=n_tok))
            ids = np.full(n_tok, -1)
            ids[: tr.turn_lengths[i]] = offset + i
            turn_ids.append(ids)
        q.append(credit.q)
        coef.append(credit.V * inv_tau)
        v.append(credit.V)
        tree_of.append(np.full(tr.num_nodes, k))
        ell.append(tr.turn_lengths)
        offset += tr.num_nodes

    def cat(xs, dtype):
        return torch.as_tensor(np.concatenate(xs), dtype=dtype)

    return Batch(
        bucket=cat(buckets, torch.long),
        token=cat(tokens, torch.long),
        turn_ids=cat(turn_ids, torch.long),
        q=cat(q, F64),
        coef=cat(coef, F64),
        V=cat(v, F64),
        tree=cat(tree_of, torch.long),
        ell=cat(ell, torch.long),
    )


def make_batch(seed: int, n_trees: int, rho: float, m: int = 4, n: int = 2, max_len: int = 5) -> Batch:
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, m, n, t_max=8, max_len=max_len, zero_len_prob=0.15) for _ in range(n_trees)]
    return pack_trees(trees, rng, rho)


def policy_logp(theta: torch.Tensor, b: Batch) -> torch.Tensor:
    return torch.log_softmax(theta, dim=-1)[b.bucket, b.token]


def turn_sum(values: torch.Tensor, b: Batch) -> torch.Tensor:
    """Σ_t values_t over each turn's loss tokens → [n]."""
    ok = b.turn_ids >= 0
    return torch.zeros(b.q.shape[0], dtype=values.dtype).index_add(0, b.turn_ids[ok], values[ok])


def loop_reference(logp: torch.Tensor, behavior: torch.Tensor, b: Batch) -> tuple[float, list[float]]:
    """Slow reference in the paper's notation: per turn s_i, KL_i with math, L = Σ ℓ_i KL_i / Σ ℓ_i."""
    lp, mu, ids = logp.tolist(), behavior.tolist(), b.turn_ids.tolist()
    num, z, s_all = 0.0, 0, []
    for i, q in enumerate(b.q.tolist()):
        diffs = [lp[t] - mu[t] for t in range(len(ids)) if ids[t] == i]
        if not diffs:
            s_all.append(0.0)
            continue
        s = sum(diffs) / len(diffs)
        p = 1.0 / (1.0 + math.exp(-s))
        kl = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
        num += len(diffs) * kl
        z += len(diffs)
        s_all.append(s)
    return num / z, s_all


def flat_grad(loss: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, theta, retain_graph=True)
    return g.flatten()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


# --------------------------------------------------------------------------------------------- §7.3


@pytest.mark.parametrize("rho", [0.1, 0.25, 0.4])
def test_gradient_identity_at_behavior(rho):
    # At θ = μ: ∇L = −(1/Z) Σ_trees (1/τ) Σ_i V_i ∇ Σ_t log π(y_{i,t}), the tree policy gradient.
    b = make_batch(seed=int(rho * 100), n_trees=16, rho=rho)
    assert int((b.ell == 0).sum()) >= 10 and int((b.turn_ids < 0).sum()) > 100
    theta = (
        torch.randn(BUCKETS, VOCAB, dtype=F64, generator=torch.Generator().manual_seed(0)) * 0.5
    ).requires_grad_()
    logp = policy_logp(theta, b)
    loss, stats = treeopsd_loss(logp, logp.detach(), b.turn_ids, b.q)
    z = float(b.ell.sum())
    assert stats["num_tokens"] == z and stats["mean_abs_s"] == 0.0
    tree_pg = (b.coef * turn_sum(logp, b)).sum()  # Σ_𝒯 (1/τ_𝒯) Σ_i V_i Σ_t log π
    g = flat_grad(loss, theta)
    g_ref = -flat_grad(tree_pg, theta) / z
    scale = float(g_ref.abs().max())
    assert scale > 1e-6
    assert float((g - g_ref).abs().max()) <= 1e-10 * scale
    # Value: Σ ℓ_i KL(q_i || ½)/Z, matching the loop reference.
    ref, _ = loop_reference(logp.detach(), logp.detach(), b)
    assert loss.item() == pytest.approx(ref, rel=1e-12, abs=1e-18)


def test_gradient_identity_off_behavior():
    # At θ ≠ μ: ∇L = (1/Z) Σ_i (σ(s_i) − q_i) Σ_t ∇ log π(y_{i,t}),
    # and the advantage form has the same gradient.
    b = make_batch(seed=7, n_trees=16, rho=0.25)
    gen = torch.Generator().manual_seed(1)
    theta0 = torch.randn(BUCKETS, VOCAB, dtype=F64, generator=gen) * 0.5
    behavior = policy_logp(theta0, b)
    theta = (theta0 + 0.3 * torch.randn(BUCKETS, VOCAB, dtype=F64, generator=gen)).requires_grad_()
    logp = policy_logp(theta, b)
    loss, stats = treeopsd_loss(logp, behavior, b.turn_ids, b.q)
    ref_value, s_ref = loop_reference(logp.detach(), behavior, b)
    assert loss.item() == pytest.approx(ref_value, rel=1e-12)
    assert stats["max_abs_s"] > 0.05
    s = torch.tensor(s_ref, dtype=F64)
    z = float(b.ell.sum())
    residual = torch.where(b.ell > 0, torch.sigmoid(s) - b.q, 0.0)
    g = flat_grad(loss, theta)
    g_ref = flat_grad((residual * turn_sum(logp, b)).sum() / z, theta)
    assert float((g - g_ref).abs().max()) <= 1e-10 * float(g_ref.abs().max())
    adv = treeopsd_advantages(logp, behavior, b.turn_ids, b.q)
    pg, _ = pg_surrogate_loss(logp, b.turn_ids, adv, stats["num_tokens"])
    assert float((flat_grad(pg, theta) - g).abs().max()) <= 1e-10 * float(g.abs().max())


def test_length_weighting_is_what_gives_the_tree_pg():
    # Without ℓ_i the gradient is Σ_i (V_i/τ)(1/ℓ_i) Σ_t ∇log π: long turns are down-weighted, so it is not
    # the tree PG (docs/algorithm.md §6b reports cosine 0.82–0.85; this batch gives ≈ 0.82).
    b = make_batch(seed=11, n_trees=16, rho=0.25, max_len=12)
    theta = torch.zeros(BUCKETS, VOCAB, dtype=F64, requires_grad=True)
    logp = policy_logp(theta, b)
    s = turn_sum(logp - logp.detach(), b) / b.ell.clamp(min=1)
    q = b.q
    kl = q * torch.log(q) + (1 - q) * torch.log1p(-q) - q * torch.nn.functional.logsigmoid(s)
    kl = kl - (1 - q) * torch.nn.functional.logsigmoid(-s)
    unweighted = kl[b.ell > 0].mean()
    tree_pg_dir = -flat_grad((b.coef * turn_sum(logp, b)).sum(), theta)
    loss, _ = treeopsd_loss(logp, logp.detach(), b.turn_ids, q)
    assert cosine(flat_grad(loss, theta), tree_pg_dir) == pytest.approx(1.0, abs=1e-12)
    cos_unweighted = cosine(flat_grad(unweighted, theta), tree_pg_dir)
    assert 0.5 < cos_unweighted < 0.97


@settings(max_examples=30, deadline=None)
@given(
    trees=st.lists(
        tree_strategy(m=(1, 4), n=(0, 2), t_max=5, max_len=4, zero_len_prob=0.2), min_size=1, max_size=3
    ),
    seed=st.integers(0, 2**31 - 1),
    rho=st.sampled_from([0.05, 0.25, 0.45]),
    scale=st.sampled_from([0.0, 0.3, 2.0]),
)
def test_random_trees_value_gradient_and_bounds(trees, seed, rho, scale):
    # On arbitrary trees: loss ≥ 0, value == loop reference, ∇L == (1/Z) Σ (σ(s)−q) Σ∇logπ, and at θ = μ the
    # gradient is the tree PG.
    rng = np.random.default_rng(seed)
    b = pack_trees(trees, rng, rho)
    gen = torch.Generator().manual_seed(seed)
    theta0 = torch.randn(BUCKETS, VOCAB, dtype=F64, generator=gen)
    behavior = policy_logp(theta0, b)
    theta = (theta0 + scale * torch.randn(BUCKETS, VOCAB, dtype=F64, generator=gen)).requires_grad_()
    logp = policy_logp(theta, b)
    loss, stats = treeopsd_loss(logp, behavior, b.turn_ids, b.q)
    assert loss.item() >= 0.0
    z = float(b.ell.sum())
    if z == 0:
        assert loss.item() == 0.0
        return
    ref_value, s_ref = loop_reference(logp.detach(), behavior, b)
    assert loss.item() == pytest.approx(ref_value, rel=1e-9, abs=1e-15)
    s = torch.tensor(s_ref, dtype=F64)
    residual = torch.where(b.ell > 0, torch.sigmoid(s) - b.q, 0.0)
    g = flat_grad(loss, theta)
    target = residual if scale > 0 else -b.coef  # at θ = μ, σ(0) − q = −V/τ
    g_ref = flat_grad((target * turn_sum(logp, b)).sum() / z, theta)
    assert float((g - g_ref).abs().max()) <= 1e-10 * max(float(g_ref.abs().max()), 1e-300)
    overshot = ((s - torch.logit(b.q)) * -torch.logit(b.q) < 0) | ((b.q == 0.5) & (s != 0))
    assert stats["overshoot_frac"] == pytest.approx(float(overshot[b.ell > 0].double().mean()))


# --------------------------------------------------------------------------------------------- §7.4


def private_batch(seed: int = 3, rho: float = 0.25) -> Batch:
    """Trees whose tokens each get their own bucket: turn-private parameters."""
    b = make_batch(seed=seed, n_trees=6, rho=rho)
    b.bucket = torch.arange(b.bucket.shape[0])
    return b


def train_private(b: Batch, loss_fn, lr: float, steps: int) -> torch.Tensor:
    """Adam on turn-private parameters from μ = θ0; returns the final s_i [n] (NaN where ℓ_i = 0)."""
    theta0 = torch.randn(b.n_buckets, VOCAB, dtype=F64, generator=torch.Generator().manual_seed(5)) * 0.05
    behavior = policy_logp(theta0, b)
    theta = theta0.clone().requires_grad_()
    opt = torch.optim.Adam([theta], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(policy_logp(theta, b), behavior).backward()
        opt.step()
    with torch.no_grad():
        s = turn_sum(policy_logp(theta, b) - behavior, b) / b.ell.clamp(min=1)
    return torch.where(b.ell > 0, s, float("nan"))


def test_fixed_point_is_log_r_star_and_ppo_clip_is_not():
    b = private_batch()
    active = b.ell > 0
    log_r_star = torch.log(b.q / (1 - b.q))
    v = b.V[active]
    assert int(active.sum()) >= 100 and float(log_r_star.abs().max()) > 0.5

    s = train_private(b, lambda lp, mu: treeopsd_loss(lp, mu, b.turn_ids, b.q)[0], lr=0.05, steps=800)[active]
    err = (s - log_r_star[active]).abs()
    assert float(err.median()) < 1e-10 and float(err.max()) < 1e-2  # s_i → log r*_i for every turn
    assert float(torch.corrcoef(torch.stack([s, v]))[0, 1]) > 0.97

    # PPO-clip with A_i = V_i on every token of turn i: stops where the clip binds, whatever the size of V.
    adv = torch.where(b.turn_ids >= 0, b.V[b.turn_ids.clamp(min=0)], 0.0)
    mask = b.turn_ids >= 0
    s_ppo = train_private(b, lambda lp, mu: grpo_loss(lp, mu, adv, mask)[0], lr=0.01, steps=800)[active]
    pos = v > 0.05
    assert int(pos.sum()) >= 20
    assert abs(float(torch.corrcoef(torch.stack([s_ppo[pos], v[pos]]))[0, 1])) < 0.5
    assert float(s_ppo[pos].std()) < 0.25 * float(s[pos].std())
    assert float(s_ppo[pos].min()) > math.log(1.2) - 0.05  # at least at the clip edge, for tiny V too


# --------------------------------------------------------------------------------------------- §7.5


def sequential_minibatches(b: Batch, lr: float, n_mb: int = 4, passes: int = 3):
    """Shared θ, fixed μ = θ0, mini-batches = groups of trees taken in turn; returns per-pass overshoot counts
    (turns with V ≠ 0 whose residual had flipped sign when their mini-batch came up) and the final θ."""
    gen = torch.Generator().manual_seed(2)
    theta0 = torch.randn(BUCKETS, VOCAB, dtype=F64, generator=gen) * 0.1
    behavior = policy_logp(theta0, b)
    theta = theta0.clone().requires_grad_()
    opt = torch.optim.Adam([theta], lr=lr)
    tok_tree = torch.where(b.turn_ids >= 0, b.tree[b.turn_ids.clamp(min=0)], -1)
    n_trees = int(b.tree.max()) + 1
    counts = []
    for _ in range(passes):
        per_mb = []
        for k in range(n_mb):
            in_mb = (tok_tree >= 0) & (tok_tree % n_mb == k)
            ids = torch.where(in_mb, b.turn_ids, -1)
            logp = policy_logp(theta, b)
            with torch.no_grad():
                s = turn_sum(torch.where(in_mb, logp - behavior, 0.0), b) / b.ell.clamp(min=1)
                turns = (b.tree % n_mb == k) & (b.ell > 0) & (b.V != 0)
                per_mb.append(
                    int((turns & (torch.sign(torch.sigmoid(s) - b.q) == torch.sign(b.q - 0.5))).sum())
                )
            loss, _ = treeopsd_loss(logp, behavior, ids, b.q)
            opt.zero_grad()
            loss.backward()
            opt.step()
        counts.append(per_mb)
    assert n_trees % n_mb == 0
    return counts, theta.detach(), behavior


def test_stale_minibatches_overshoot_and_are_pulled_back():
    b = make_batch(seed=21, n_trees=32, rho=0.25)
    slow, _, _ = sequential_minibatches(b, lr=0.01)
    fast, theta, behavior = sequential_minibatches(b, lr=0.05)
    assert slow[0][0] == 0 and fast[0][0] == 0  # first mini-batch of the step: s = 0, nobody has moved
    assert sum(fast[-1]) > sum(slow[-1]) and sum(fast[-1]) >= 8
    # In the final state, find overshot turns and check that their own loss pulls s back toward log r*.
    logp = policy_logp(theta, b)
    s = turn_sum(logp - behavior, b) / b.ell.clamp(min=1)
    log_r_star = torch.log(b.q / (1 - b.q))
    over = (b.ell > 0) & (b.V != 0) & ((s - log_r_star) * (0 - log_r_star) < 0)
    idx = torch.nonzero(over).flatten()
    assert idx.numel() >= 5
    for i in idx.tolist():
        residual = torch.sigmoid(s[i]) - b.q[i]
        # Sign check: σ(s) − q has the sign of s − log r* (and the opposite of its value ½ − q at s = 0).
        assert torch.sign(residual) == torch.sign(s[i] - log_r_star[i]) == -torch.sign(0.5 - b.q[i])
        th = theta.clone().requires_grad_()
        own_loss, _ = treeopsd_loss(policy_logp(th, b), behavior, torch.where(b.turn_ids == i, i, -1), b.q)
        (g,) = torch.autograd.grad(own_loss, th)
        s_after = turn_sum(policy_logp(theta - 1e-3 * g, b) - behavior, b)[i] / b.ell[i]
        assert abs(float(s_after - log_r_star[i])) < abs(float(s[i] - log_r_star[i]))


# ------------------------------------------------------------------------------------------- §11.1


@pytest.mark.parametrize("mode", ["token_tis", "geo_tis", "token_mask", "prod_tis", "prod_mis"])
def test_gradient_identity_at_proximal(mode):
    # μ sampled the tokens; π_prox (step-start weights) ≠ μ. With s_i = Σ_t c_t (log π − log π_prox) / Σ_t c_t
    # and turn weight Σ_t c_t, the gradient at θ = π_prox is −(1/Z) Σ_𝒯 (1/τ) Σ_i V_i Σ_t c_t ∇log π(y_{i,t}):
    # the tree policy gradient with each token importance-weighted by c_t (token_tis: min(π_prox/μ, C);
    # geo_tis: the turn's geometric-mean ratio, truncated; token_mask: 1 inside the band, else 0; prod_tis:
    # the turn's product ratio, truncated; prod_mis: the product, 0 above C). Z stays Σ ℓ_i of every turn.
    b = make_batch(seed=21, n_trees=12, rho=0.25)
    gen = torch.Generator().manual_seed(3)
    theta_mu = torch.randn(BUCKETS, VOCAB, dtype=F64, generator=gen) * 0.5
    theta = (theta_mu + 0.4 * torch.randn(BUCKETS, VOCAB, dtype=F64, generator=gen)).requires_grad_()
    behavior, logp = policy_logp(theta_mu, b), policy_logp(theta, b)
    prox = logp.detach()  # θ = π_prox: the start of a step
    on = b.turn_ids >= 0
    c, st = correction_weights(mode, prox, behavior, on, b.turn_ids, 1.5, (0.8, 1.25))
    assert 0 < st["is_clipped_tokens"] + st["is_masked_tokens"] < st["is_tokens"]  # the threshold binds
    z = float(b.ell.sum())
    loss, stats = treeopsd_loss(logp, prox, b.turn_ids, b.q, z_total=z, token_weights=c)
    assert stats["mean_abs_s"] == 0.0
    weighted_pg = (b.coef * turn_sum(c * logp, b)).sum()  # Σ (1/τ) Σ_i V_i Σ_t c_t log π, c constant
    g, g_ref = flat_grad(loss, theta), -flat_grad(weighted_pg, theta) / z
    assert float(g_ref.abs().max()) > 1e-6
    assert float((g - g_ref).abs().max()) <= 1e-10 * float(g_ref.abs().max())


def test_importance_weights_make_the_proximal_gradient_unbiased():
    # One turn, one token from a 6-way μ; teacher q. E_μ[c ∇] with c = π_prox/μ (no truncation: C above the
    # largest ratio) equals the gradient an on-policy sample of π_prox would give,
    # Σ_y π_prox(y)(½ − q) ∇log π(y).
    # Exact expectation: sum over the 6 outcomes weighted by μ(y).
    gen = torch.Generator().manual_seed(5)
    theta = torch.randn(VOCAB, dtype=F64, generator=gen).requires_grad_()
    mu = torch.softmax(torch.randn(VOCAB, dtype=F64, generator=gen), -1)
    q = torch.tensor([0.8], dtype=F64)
    expected = torch.zeros(VOCAB, dtype=F64)
    for y in range(VOCAB):
        logp = torch.log_softmax(theta, -1)[y : y + 1]
        one = torch.tensor([0])
        c, _ = correction_weights("token_tis", logp.detach(), mu[y].log()[None], one >= 0, one, 1e6, (0.5, 2))
        loss, _ = treeopsd_loss(logp, logp.detach(), torch.tensor([0]), q, token_weights=c)
        expected += mu[y] * flat_grad(loss, theta)
    pi = torch.softmax(theta.detach(), -1)
    on_policy = sum(pi[y] * (0.5 - q[0]) * (torch.eye(VOCAB, dtype=F64)[y] - pi) for y in range(VOCAB))
    assert float((expected - on_policy).abs().max()) <= 1e-12
