"""μ and π describe one distribution (docs/algorithm.md §11): trees the HF backend samples at a temperature,
top-p and top-k, then scored by the learner at the same weights, give a mismatch KL of ~0; the learner
scoring the raw model instead (what it did before) is far off, so the check can fail. The vLLM twin of this
test is in test_vllm_backend.py (it shares the session's engine)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.policy.hf_backend import HFBackend
from configs.schema import load_config
from learner.learner import Learner
from runtime.builder import make_sampler
from system.credit import credit_rollout_tree
from system.policy import SamplingConfig

SETTINGS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (0.6, 0.95, 20)]  # (temperature, top_p, top_k); 0 = top-k off


def sampling_config(temperature: float, top_p: float, top_k: int, max_turn_tokens: int = 16):
    """Small trees (M=2, N=1, 3 turns) sampled at the given setting; one mini-batch (both twins)."""
    sampling = [f"sampler.temperature={temperature}", f"sampler.top_p={top_p}", f"sampler.top_k={top_k}"]
    shape = ["algo.M=2", "algo.N=1", "env.max_turns=3", f"env.max_turn_tokens={max_turn_tokens}"]
    return load_config(overrides=[*sampling, *shape, "learner.minibatches=1"])


def sampled_trees(model_dir: str, temperature: float, top_p: float, top_k: int, n: int = 4):
    cfg = sampling_config(temperature, top_p, top_k)
    backend = HFBackend(model_dir, sampling=SamplingConfig.of(cfg.sampler, seed=3))
    trees = make_sampler(cfg, model_dir, backend=backend).sample(n)
    return cfg, [credit_rollout_tree(t, cfg.algo) for t in trees]


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SETTINGS)
def test_learner_scores_hf_trees_under_their_sampling_distribution(tiny_model_dir, temperature, top_p, top_k):
    torch.manual_seed(0)
    cfg, trees = sampled_trees(tiny_model_dir, temperature, top_p, top_k)
    stats = Learner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg).step(trees)
    assert abs(stats["learner/mismatch_kl"]) < 1e-4, stats["learner/mismatch_kl"]
    assert abs(stats["learner/mismatch_kl_k3"]) < 1e-4, stats["learner/mismatch_kl_k3"]


def test_scoring_the_raw_model_instead_is_far_off(tiny_model_dir):
    _, trees = sampled_trees(tiny_model_dir, 0.7, 0.9, 0)
    raw = load_config(overrides=["algo.M=2", "algo.N=1", "learner.minibatches=1"])  # T = 1, top-p 1
    stats = Learner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), raw).step(trees)
    assert abs(stats["learner/mismatch_kl"]) > 1e-2  # the bias the shared distribution removes
