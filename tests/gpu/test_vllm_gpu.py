"""The vLLM sampler on a CUDA GPU (`make gpu-check`; skipped without a GPU or without vLLM): the engine
starts with the GPU defaults (bf16, prefix caching), the asynchronous agent loop samples valid trees on
it, its tokens/s is printed against the bare async engine on the same requests, and a bf16 weight version
is loaded in place (no file) with its apply time printed. Speed figures are printed, not asserted (speed
goals live in benchmarks); the sampler's stored log-probs are asserted against the learner's re-scoring."""

from __future__ import annotations

import importlib.util
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (the gpu extra)"),
]
EPISODES = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from actors.policy.vllm_backend import VLLMBackend
    from tests.vllm_fixtures import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_gpu"))
    backend = VLLMBackend(str(folder), seed=0, extra_engine_args={"gpu_memory_utilization": 0.2})
    try:
        yield folder, backend
    finally:
        backend.close()


def test_gpu_defaults_and_trees_from_the_async_loop(engine: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np
    from transformers import AutoTokenizer

    from actors.agent_loop import LoopLimits
    from actors.chat import ChatFormat
    from actors.envs.synthetic_kb import KBConfig, SyntheticKBEnv
    from actors.tree_sampler import TreeSampler, TreeShape

    folder, backend = engine
    assert backend._engine().args["dtype"] == "bfloat16"  # the GPU default
    assert backend._engine().args["enable_prefix_caching"] is True
    env = SyntheticKBEnv(config=KBConfig(n_persons=40, n_companies=10, n_cities=12, n_countries=5))
    chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(folder))
    limits = LoopLimits(max_turns=3, max_turn_tokens=32, token_budget=600)
    sampler = TreeSampler(backend, env, chat, TreeShape(M=4, N=0), limits, max_inflight=EPISODES)
    t0 = time.perf_counter()
    trees = sampler.sample_trees(env.tasks("train", n=EPISODES // 4), np.random.default_rng(0))
    sampler_s = time.perf_counter() - t0
    assert len(trees) == EPISODES // 4 and all(len(t.children[0]) == 4 for t in trees)
    tokens = sum(len(n.tokens) for t in trees for n in t.nodes)
    assert sampler.stats["sampler/inflight_peak"] == EPISODES
    with capsys.disabled():
        print(
            f"\n[gpu vllm] async loop: {EPISODES} episodes, {tokens} tokens, {tokens / sampler_s:,.0f} tok/s"
        )


def learner_logprobs(folder: Path, contexts: list[list[int]], turns: list[Any], sampling: Any) -> Any:
    """[n, T] the learner's log-probs of each sampled turn token: `learner/forward.py:token_logprobs` on plain
    causal rows, as the bf16 learner runs it (fp32 weights under bf16 autocast, `learner/device.py`; the LM
    head and the sampling transform `sampling_logprobs(..., keep=labels)` in fp32, outside autocast)."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.device import compute_scope
    from system.sampling import sampling_logprobs

    dev = torch.device("cuda")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev).eval()
    start = len(contexts[0])  # every context has the same length and every turn max_new_tokens tokens
    ids = torch.tensor([c + list(t.token_ids) for c, t in zip(contexts, turns, strict=True)], device=dev)
    labels = ids[:, start:]
    with torch.no_grad():
        with compute_scope(dev, "bfloat16"):
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, start - 1 : -1]
        with torch.autocast(dev.type, enabled=False):
            logits = model.get_output_embeddings()(hidden.float()).float()
        dist = sampling_logprobs(logits, sampling, keep=labels)
    return dist.gather(-1, labels[..., None])[..., 0].double().cpu()


def test_gpu_sampler_against_the_bare_engine(engine: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from system.policy import SampleRequest

    folder, backend = engine
    rng = random.Random(1)
    contexts = [[rng.randrange(3, 1000) for _ in range(200)] for _ in range(EPISODES)]
    requests = [SampleRequest(context=c, max_new_tokens=128, seed=i) for i, c in enumerate(contexts)]

    async def turns() -> list[Any]:
        import asyncio

        return list(await asyncio.gather(*(backend.generate_turn(r) for r in requests)))

    backend.reset_prefix_cache()
    t0 = time.perf_counter()
    ours = backend.run_async(turns())
    ours_s = time.perf_counter() - t0
    final = RequestOutputKind.FINAL_ONLY  # as the sampler asks: one output per request
    params = [
        SamplingParams(max_tokens=128, ignore_eos=True, logprobs=0, seed=i, output_kind=final)
        for i in range(EPISODES)
    ]
    backend.reset_prefix_cache()
    t0 = time.perf_counter()
    items = [(TokensPrompt(prompt_token_ids=c), p) for c, p in zip(contexts, params, strict=True)]
    raw = backend.generate_raw(items)
    raw_s = time.perf_counter() - t0
    n = sum(len(r.token_ids) for r in ours)
    assert n == sum(len(o.outputs[0].token_ids) for o in raw) == EPISODES * 128
    # The stored log-probs (vLLM's processed_logprobs, bf16 engine) against the learner's re-scoring of the
    # same turns at the same weights. d = log π_learner − log μ_vllm per token; k3 = mean(e^d − 1 − d), the
    # learner's `mismatch_kl_k3` (learner/diagnostics.py). Tolerances for bf16 on GPU (engine and learner
    # both compute in bf16, ~3 significant digits; the fp32 CPU twin in tests/component/test_vllm_backend.py
    # holds |d| < 1e-3): mean |d| ≤ 0.05 and k3 ≤ 0.01.
    stored = torch.tensor([r.logprobs for r in ours], dtype=torch.float64)
    d = learner_logprobs(folder, contexts, ours, backend.sampling) - stored
    assert bool(torch.isfinite(d).all())
    mean_abs, k3 = float(d.abs().mean()), float((torch.expm1(d) - d).mean())
    with capsys.disabled():
        print(f"\n[gpu vllm] {EPISODES} turns x 128: sampler_over_raw {raw_s / ours_s:.3f}")
        print(f"[gpu vllm] stored vs learner log-probs: mean |Δ| {mean_abs:.2e}, k3 {k3:.2e}")
    assert mean_abs <= 0.05 and k3 <= 0.01, (mean_abs, k3)


def test_gpu_weights_in_place_in_bf16(engine: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from safetensors.torch import load_file

    folder, backend = engine
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(Path(folder) / "model.safetensors")).items()}
    ctx = list(range(5, 105))
    before = backend.score(ctx, 50)
    v0 = backend.version
    backend.load_weights(state, version=v0 + 1)
    after = backend.score(ctx, 50)
    assert backend.version == v0 + 1 and backend.weight_transfer == "shared"  # the memfd, no file
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) < 5e-2  # the same weights, in bf16
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    with capsys.disabled():
        print(f"\n[gpu vllm] weights in place: {mb:.1f} MB bf16 in {backend.last_load_s * 1e3:.1f} ms")
