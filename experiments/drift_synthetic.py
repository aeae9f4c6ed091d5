"""A synthetic family where every quantity of the off-policy question is known: turns of L tokens from a
position-wise categorical policy, whole-turn credit standardized within each group of K turns, and a
behaviour policy μ at a chosen per-token KL κ from π_prox (docs/algorithm.md §11.1; `make offpolicy-table`
part 1 and tests/unit/test_drift_synthetic.py).

    π_prox(y) = Π_t softmax(θ)[y_t],   μ(y) = Π_t softmax(θ + δ_t)[y_t],   mean_t KL(μ_t ‖ π_prox) = κ
    R(y) = Σ_t a[y_t] / √L,   V = z-standardized R in each group (ddof 1),   q = 1/2 + V/τ

θ ∈ R^V is shared by every position (as a model's weights are), so a batch's gradient is low-dimensional
and its bias shows; a turn's drift is D = Σ_t KL_t = L·κ. `random` drift draws each δ_t at random;
`aligned` drift puts μ where a stale learner was: δ_t ∝ ∇L_on for every t (θ_old = θ + step · ∇L_on: the
learner has since stepped against the on-policy loss gradient). Each mode's batch gradient goes through the
project's own `correction_weights` and `treeopsd_loss` (autograd at θ = π_prox); the on-policy reference
ḡ_on is the mean over many on-policy batches of the same gradient in closed form (at θ = π_prox,
∂L/∂θ = Σ_i (1/2 − q_i) Σ_t (onehot(y_it) − π) / Z).

Reported per mode: the expected cosine of one batch's gradient to ḡ_on (what a step at the production batch
size gets: bias and variance together) and its paired difference to the best mode, over the same μ batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from learner.losses import treeopsd_loss
from learner.rollout_correction import correction_weights

Drift = Literal["random", "aligned"]
MODES = ("none", "token_tis", "prod_tis", "prod_mis", "tr_mask")
F64 = torch.float64


@dataclass(frozen=True)
class Cell:
    length: int  # L, tokens per turn
    kappa: float  # κ, per-token KL(μ ‖ π_prox)
    drift: Drift

    @property
    def turn_kl(self) -> float:
        return self.length * self.kappa


@dataclass(frozen=True)
class Family:
    """The fixed parts: vocabulary, group size K, groups per batch B, ρ, the truncation C, the mask bound."""

    vocab: int = 16
    group: int = 12
    groups_per_batch: int = 8
    rho: float = 0.25
    threshold: float = 2.0
    tr_bound: float = 0.1

    @property
    def tau(self) -> float:
        return (self.group - 1) / (self.rho * math.sqrt(self.group))


@dataclass
class Problem:
    theta: torch.Tensor  # [V] logits of π_prox, every position
    mu: torch.Tensor  # [L, V] logits of μ per position
    reward: torch.Tensor  # [V] the reward of each token


def position_kl(mu_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[L] KL(softmax(mu_logits_t) ‖ softmax(logits)) per position (logits [V] or [L, V])."""
    lmu, lpi = mu_logits.log_softmax(-1), logits.log_softmax(-1)
    return (lmu.exp() * (lmu - lpi)).sum(-1)


def scale_to_kl(theta: torch.Tensor, direction: torch.Tensor, kappa: float) -> torch.Tensor:
    """θ + s·direction with s ≥ 0 such that the mean per-position KL(μ ‖ π) is κ (bisection; KL grows with s
    along a fixed direction near 0). θ [V], direction [L, V]."""
    lo, hi = 0.0, 1.0
    while float(position_kl(theta + hi * direction, theta).mean()) < kappa:
        hi *= 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(position_kl(theta + mid * direction, theta).mean()) < kappa else (lo, mid)
    return theta + (lo + hi) / 2 * direction


def sample_turns(logits: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, L] token ids, each position drawn from its own categorical (logits [L, V])."""
    probs = logits.softmax(-1)
    return torch.multinomial(probs, n, replacement=True, generator=gen).T.contiguous()


def teacher(problem: Problem, tokens: torch.Tensor, fam: Family) -> torch.Tensor:
    """[n] q = 1/2 + V/τ with V the group-standardized whole-turn reward (groups of K consecutive turns)."""
    r = problem.reward[tokens].sum(1) / math.sqrt(tokens.shape[1])  # [n]
    g = r.view(-1, fam.group)
    z = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)
    return (0.5 + z / fam.tau).flatten()


def on_policy_gradient(problem: Problem, tokens: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[V] the TreeOPSD gradient of one on-policy batch at θ = π_prox, closed form (module docstring)."""
    n, length = tokens.shape
    probs = problem.theta.softmax(-1)
    coef = (0.5 - q).to(F64)  # per turn
    counts = torch.zeros_like(probs).index_add_(0, tokens.flatten(), coef.repeat_interleave(length))
    return (counts - length * coef.sum() * probs) / (n * length)


def mode_gradient(
    problem: Problem, tokens: torch.Tensor, q: torch.Tensor, mode: str, fam: Family
) -> torch.Tensor:
    """[V] one μ batch's gradient under `mode`, through correction_weights and treeopsd_loss."""
    n, length = tokens.shape
    theta = problem.theta.clone().requires_grad_(True)
    pos = torch.arange(length).expand(n, length).flatten()
    logp = theta.log_softmax(-1)[tokens.flatten()]
    behavior = problem.mu.log_softmax(-1)[pos, tokens.flatten()]
    turn = torch.arange(n).repeat_interleave(length)
    on = torch.ones_like(turn, dtype=torch.bool)
    weights, _ = correction_weights(
        mode,  # type: ignore[arg-type]
        logp.detach(),
        behavior,
        on,
        turn,
        fam.threshold,
        (0.5, 2.0),
        fam.tr_bound,
    )
    loss, _ = treeopsd_loss(logp, logp.detach(), turn, q, token_weights=None if mode == "none" else weights)
    (grad,) = torch.autograd.grad(loss, theta)
    return grad


def make_problem(cell: Cell, fam: Family, seed: int, reference: torch.Tensor | None = None) -> Problem:
    """π_prox, μ at the cell's κ, and the reward table. Aligned drift needs `reference` (ḡ_on at θ)."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(fam.vocab, generator=gen, dtype=F64)
    reward = torch.randn(fam.vocab, generator=gen, dtype=F64)
    if cell.drift == "random":
        direction = torch.randn(cell.length, fam.vocab, generator=gen, dtype=F64)
    else:
        if reference is None:
            raise ValueError("aligned drift needs the on-policy gradient")
        direction = (reference / reference.norm()).expand(cell.length, fam.vocab)
    return Problem(theta, scale_to_kl(theta, direction, cell.kappa), reward)


def reference_gradient(problem: Problem, fam: Family, batches: int, gen: torch.Generator) -> torch.Tensor:
    total = torch.zeros_like(problem.theta)
    n = fam.group * fam.groups_per_batch
    for _ in range(batches):
        tokens = sample_turns(problem.theta.expand_as(problem.mu), n, gen)
        total += on_policy_gradient(problem, tokens, teacher(problem, tokens, fam))
    return total / batches


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()).clamp(min=1e-300))


def measure_cell(
    cell: Cell, fam: Family, seed: int, batches: int = 32, reference_batches: int = 200
) -> dict[str, list[float]]:
    """Per mode, the cosine of each μ batch's gradient to ḡ_on (the same μ batches for every mode)."""
    gen = torch.Generator().manual_seed(seed + 1)
    problem = make_problem(Cell(cell.length, cell.kappa, "random"), fam, seed)
    if cell.drift == "aligned":  # μ behind θ along the on-policy loss gradient
        problem = make_problem(cell, fam, seed, reference_gradient(problem, fam, reference_batches // 4, gen))
    g_on = reference_gradient(problem, fam, reference_batches, gen)
    out: dict[str, list[float]] = {m: [] for m in MODES}
    n = fam.group * fam.groups_per_batch
    for _ in range(batches):
        tokens = sample_turns(problem.mu, n, gen)
        q = teacher(problem, tokens, fam)
        for mode in MODES:
            out[mode].append(cosine(mode_gradient(problem, tokens, q, mode, fam), g_on))
    return out


def summarize(cosines: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per mode: mean cosine, and its paired difference to the best mode (mean, se over batches)."""
    means = {m: sum(v) / len(v) for m, v in cosines.items()}
    best = max(means, key=lambda m: means[m])
    out = {}
    for mode, values in cosines.items():
        diffs = [a - b for a, b in zip(values, cosines[best], strict=True)]
        out[mode] = {"cosine": means[mode], "below_best": _mean(diffs), "below_best_se": _se(diffs)}
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _se(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1) / len(xs))
