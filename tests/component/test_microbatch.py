"""Token-budget micro-batches (learner/minibatch.py, system/microbatch.py): the gradient accumulated over
micro-batches, trees split into subtrees included, equals the one-shot gradient of the same mini-batch for
all four losses; bf16 and gradient checkpointing run and stay close to fp32."""

import copy

import pytest
import torch
from learner_fixtures import config, make_trees, on_policy

from actors.policy.tiny_model import build_tiny_model
from learner.learner import Learner
from system.microbatch import split_tree

torch.set_num_threads(1)
BIG = {"prompt": (6, 10), "turn": (4, 8), "obs": (3, 5), "turns": (2, 4)}
METHODS = ["treeopsd", "grpo", "gspo", "treepo"]


def grads(learner: Learner, trees) -> tuple[torch.Tensor, int]:
    """The first mini-batch's accumulated gradient (no optimizer step) and its micro-batch count."""
    batches, _ = learner.plan(trees)
    assert learner.cfg.learner.minibatches == learner.cfg.learner.epochs == 1  # .grad: this mini-batch's
    learner.step(trees)  # the step leaves the mini-batch's accumulated gradient in .grad
    flat = torch.cat([p.grad.flatten() for p in learner.model.parameters() if p.grad is not None])
    return flat, len(batches[0])


def learner_for(model, method: str, budget: int, **learner_keys) -> Learner:
    algo = {"method": method, "rho": 0.4, "zero_var_trees": "keep", "treepo_filter_zero_std": False}
    keys = {"minibatches": 1, "max_tokens_per_microbatch": budget, **learner_keys}
    return Learner(copy.deepcopy(model), config(algo=algo, learner=keys))


@pytest.fixture(scope="module")
def setup(tok):
    model = build_tiny_model(tok, seed=2)
    trees = on_policy(model, make_trees(tok, n=4, seed=7, **BIG))
    return model, trees


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("packed", [True, False])
def test_microbatched_gradient_equals_one_shot(setup, method, packed):
    model, trees = setup
    budget = 60 if packed else 200
    if packed:  # the budget must split at least one tree into subtrees, or the test proves less
        assert max(len(split_tree(k, t, budget)) for k, t in enumerate(trees)) >= 2
    ref, n_ref = grads(learner_for(model, method, 0, packed_forward=packed), trees)
    got, n_got = grads(learner_for(model, method, budget, packed_forward=packed), trees)
    assert n_ref == 1 and n_got >= 3
    assert float(ref.norm()) > 1e-6  # a zero gradient would make the comparison empty
    rel = float((got - ref).norm() / ref.norm())
    assert rel <= 1e-6, f"{method}: relative gradient difference {rel:.2e} over {n_got} micro-batches"


def test_depth_corrected_microbatches_match(setup):
    model, trees = setup
    keys = {"method": "treeopsd", "rho": 0.4, "depth_correction": True}
    one = Learner(copy.deepcopy(model), config(algo=keys, learner={"minibatches": 1}))
    many = Learner(
        copy.deepcopy(model), config(algo=keys, learner={"minibatches": 1, "max_tokens_per_microbatch": 60})
    )
    ref, _ = grads(one, trees)
    got, n = grads(many, trees)
    assert n >= 3 and float((got - ref).norm() / ref.norm()) <= 1e-6


def test_step_reports_microbatches_and_same_loss(setup):
    """A whole step with micro-batches: the mini-batch loss is the sum of the shares, so the logged loss
    equals the one-shot step's (both start from the same weights)."""
    model, trees = setup
    one = learner_for(model, "treeopsd", 0, minibatches=2)
    many = learner_for(model, "treeopsd", 60, minibatches=2)
    a, b = one.step(trees), many.step(trees)
    assert a["learner/microbatches"] == 2 and b["learner/microbatches"] > 2
    assert b["learner/mb0/loss"] == pytest.approx(a["learner/mb0/loss"], rel=1e-5)
    assert b["learner/loss_tokens"] == a["learner/loss_tokens"]


def test_grad_checkpointing_gives_the_same_gradient(setup):
    """Checkpointing re-runs each layer inside backward; with the tree kernel held over backward the
    recomputed attention is the same, so the gradient matches (fp32, ≤ 1e-5 relative)."""
    model, trees = setup
    ref, _ = grads(learner_for(model, "treeopsd", 60), trees)
    got, _ = grads(learner_for(model, "treeopsd", 60, grad_checkpointing=True), trees)
    assert float((got - ref).norm() / ref.norm()) <= 1e-5


def test_bf16_steps_track_fp32(setup):
    """bf16 autocast over fp32 master weights: two steps run, the parameters stay fp32, and the loss is
    within bf16 tolerance of fp32's. bf16 keeps 8 mantissa bits (relative rounding 2^-8 ≈ 0.4 %); over the
    two layers and the log-ratio s = mean(log π − log μ) the loss differs by a few of those: 2 % relative,
    or 1e-3 absolute for a loss near zero (measured: 3e-5 and 1.2e-3 relative)."""
    model, trees = setup
    runs = {}
    for precision in ("float32", "bfloat16"):
        learner = learner_for(model, "treeopsd", 60, precision=precision, grad_checkpointing=True)
        runs[precision] = [learner.step(trees)["learner/loss"] for _ in range(2)]
        assert all(p.dtype == torch.float32 for p in learner.model.parameters())
        assert all(s["exp_avg"].dtype == torch.float32 for s in learner.optimizer.state.values())
        # weights.dtype = auto: the broadcast follows the training precision
        assert {t.dtype for t in learner.named_weights().values()} == {getattr(torch, precision)}
    for f32, b16 in zip(runs["float32"], runs["bfloat16"], strict=True):
        assert b16 == pytest.approx(f32, rel=0.02, abs=1e-3)
