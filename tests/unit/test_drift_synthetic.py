"""`auto`'s off-policy correction against every mode on the synthetic family of experiments/drift_synthetic.py
(docs/algorithm.md §11.1): turns of L ∈ {256, 1024} tokens at per-token KL κ ∈ {3e-4, 1e-3, 3e-3} (turn KL
0.08–3.1), random and staleness-aligned drift. Every mode's batch gradient goes through `correction_weights`
and `treeopsd_loss`; the reference is π_prox's on-policy gradient, computed in the same test (closed form,
checked against autograd below)."""

from __future__ import annotations

import itertools

import pytest
import torch

from configs.algo import AlgoConfig
from experiments.drift_synthetic import (
    Cell,
    Family,
    Problem,
    make_problem,
    measure_cell,
    mode_gradient,
    on_policy_gradient,
    position_kl,
    sample_turns,
    summarize,
    teacher,
)

FAMILY = Family()
CELLS = [
    Cell(L, k, d) for L, k, d in itertools.product((256, 1024), (3e-4, 1e-3, 3e-3), ("random", "aligned"))
]


def test_the_family_is_what_it_says():
    cell = Cell(64, 1e-3, "random")
    problem = make_problem(cell, FAMILY, seed=0)
    assert float(position_kl(problem.mu, problem.theta).mean()) == pytest.approx(1e-3, rel=1e-6)  # κ, exactly
    gen = torch.Generator().manual_seed(1)
    tokens = sample_turns(problem.theta.expand_as(problem.mu), 96, gen)
    q = teacher(problem, tokens, FAMILY)
    groups = q.view(-1, FAMILY.group) - 0.5  # V/τ: standardized within each group of K, so it sums to 0
    assert groups.sum(1).abs().max() < 1e-9 and float(q.min()) > 0 and float(q.max()) < 1
    # on-policy (μ = π_prox), the closed form is the autograd gradient of the project's loss
    on_policy = Problem(problem.theta, problem.theta.expand_as(problem.mu), problem.reward)
    closed, autograd = (
        on_policy_gradient(problem, tokens, q),
        mode_gradient(on_policy, tokens, q, "none", FAMILY),
    )
    assert torch.allclose(closed, autograd, atol=1e-15, rtol=1e-9)


def test_auto_is_within_0_02_of_the_best_mode_in_every_cell():
    auto = AlgoConfig().resolved(off_policy=True)["rollout_correction"]
    worst_gap = {}
    for i, cell in enumerate(CELLS):
        summary = summarize(measure_cell(cell, FAMILY, seed=i, batches=12, reference_batches=60))
        best = max(s["cosine"] for s in summary.values())
        worst_gap[(cell.length, cell.kappa, cell.drift)] = best - summary[auto]["cosine"]
    assert max(worst_gap.values()) <= 0.02, worst_gap
