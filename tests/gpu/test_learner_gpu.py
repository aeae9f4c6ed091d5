"""The learner on a CUDA device (`make gpu-check`; skipped without a GPU): bf16 steps, token-budget
micro-batches, FlexAttention compiled forward and backward against the chunked plan."""

import copy

import pytest
import torch
from learner_fixtures import config, make_trees, on_policy

from actors.policy.tiny_model import build_tiny_model
from learner.flex_attention import BUCKETS, compiled_graphs
from learner.forward import token_logprobs
from learner.learner import Learner
from learner.packing import canonical_logp, pack_trees

pytestmark = pytest.mark.gpu
BIG = {"prompt": (6, 10), "turn": (4, 8), "obs": (3, 5), "turns": (2, 4)}
GPU = {"resources": {"learner": {"num_gpus": 1}}}


@pytest.fixture(scope="module")
def setup(tok):
    torch.backends.cuda.matmul.allow_tf32 = False  # equivalence checks in true fp32
    torch.backends.cudnn.allow_tf32 = False
    model = build_tiny_model(tok, hidden=128, layers=2, heads=4, kv_heads=2, seed=3)
    trees = on_policy(model, make_trees(tok, n=4, seed=9, **BIG))
    return model, trees


def gpu_learner(model, **learner_keys) -> Learner:
    cfg = config(learner={"minibatches": 1, **learner_keys}, **GPU)
    return Learner(copy.deepcopy(model), cfg)


def first_grad(learner: Learner, trees) -> torch.Tensor:
    assert learner.cfg.learner.minibatches == learner.cfg.learner.epochs == 1  # .grad: this mini-batch's
    learner.step(trees)  # the step leaves the mini-batch's accumulated gradient in .grad
    return torch.cat([p.grad.flatten() for p in learner.model.parameters() if p.grad is not None])


def test_learner_runs_on_cuda_in_bf16(setup):
    model, trees = setup
    learner = gpu_learner(model, precision="bfloat16", grad_checkpointing=True, max_tokens_per_microbatch=60)
    assert next(learner.model.parameters()).device.type == "cuda" and learner.attention == "flex"
    before = compiled_graphs()
    stats = [learner.step(trees) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(s["learner/loss"])) for s in stats)
    assert stats[0]["learner/microbatches"] >= 3
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())  # fp32 master weights
    # micro-batches padded to the 60-token budget's buckets (128 … 512): at most one graph per bucket
    # (a second per length if the kernel breaks its graph), and none after the first step's lengths
    assert stats[0]["learner/compiles"] - before <= 2 * BUCKETS
    assert stats[2]["learner/compiles"] == stats[0]["learner/compiles"]
    assert 0 < stats[0]["learner/pad_frac"] < 1


@pytest.mark.parametrize("attention", ["tree", "flex"])
def test_microbatched_gradient_equals_one_shot_on_cuda(setup, attention):
    model, trees = setup
    ref = first_grad(gpu_learner(model, tree_attention="chunked" if attention == "tree" else "flex"), trees)
    got = first_grad(
        gpu_learner(
            model, tree_attention="chunked" if attention == "tree" else "flex", max_tokens_per_microbatch=60
        ),
        trees,
    )
    assert float((got - ref).norm() / ref.norm()) <= 1e-5


def test_flex_matches_the_chunked_plan_forward_and_backward(setup):
    """Compiled FlexAttention and the chunked SDPA plan: the same log-probs (≤ 1e-4 fp32) and gradients."""
    model, trees = setup
    model = copy.deepcopy(model).cuda()
    packed = pack_trees(trees, concat=True).to("cuda")
    out = {}
    for attention in ("tree", "flex"):
        model.zero_grad()
        lp = token_logprobs(model, packed, attention)
        keys, vals = canonical_logp(packed, lp)
        vals.sum().backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        out[attention] = (keys, vals.detach(), grad)
    assert torch.equal(out["tree"][0], out["flex"][0])
    torch.testing.assert_close(out["flex"][1], out["tree"][1], atol=1e-4, rtol=0)
    g_ref, g = out["tree"][2], out["flex"][2]
    assert float((g - g_ref).norm() / g_ref.norm()) <= 1e-4
