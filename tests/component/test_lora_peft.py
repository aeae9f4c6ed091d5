"""Our LoRA adapter as a PEFT folder (storage/lora_peft.py), the vLLM sampler's adapter bookkeeping without
an engine (actors/policy/vllm_lora.py: base fingerprint from the checkpoint's files, release of an adapter
after its last request, refusals) and `treeopsd export` of a LoRA run (merged folder and PEFT adapter), on
the tiny Qwen2 model of the learner tests."""

import asyncio
import json
from pathlib import Path

import pytest
import torch
from learner_fixtures import config, make_trees
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from actors.policy.hf_lora import AdapterMerge
from actors.policy.tiny_model import build_tiny_model
from actors.policy.vllm_lora import VLLMAdapters, checkpoint_samples, lora_engine_args
from actors.policy.vllm_weights import checkpoint_layout
from configs.lora import PROJECTIONS, LoraConfig
from launch.cli import main
from learner import lora
from learner.learner import Learner
from storage.lora_peft import read_peft, write_peft
from system.lora_sync import AdapterMismatch, adapter_message, fingerprint_of

torch.set_num_threads(1)
RANK, ALPHA = 4, 8.0  # scaling 8 / 4 = 2
N_LAYERS = 2 * 7  # 2 decoder layers × 7 projections


def adapted(tok, seed=5, b_seed=0):
    model = lora.apply_lora(build_tiny_model(tok, seed=seed), LoraConfig(rank=RANK, alpha=ALPHA))
    gen = torch.Generator().manual_seed(b_seed)
    with torch.no_grad():
        for layer in lora.lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.05)
    return model


def logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_peft_folder_names_config_and_round_trip(tok, tmp_path):
    model = adapted(tok)
    tensors = lora.adapter_state(model)
    write_peft(tmp_path / "a", tensors, scaling=2.0, rank=RANK, base_model="/m/tiny", fingerprint="f" * 16)
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["bias"]) == ("LORA", 4, 8.0, "none")  # 2·4
    assert cfg["target_modules"] == sorted(PROJECTIONS) and cfg["base_model_name_or_path"] == "/m/tiny"
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert len(keys) == 2 * N_LAYERS == 28  # an A and a B per adapted layer
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys  # PEFT's names
    back, meta = read_peft(tmp_path / "a")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert meta["scaling"] == 2.0 and meta["rank"] == 4 and meta["base_fingerprint"] == "f" * 16
    (tmp_path / "b").mkdir()
    with pytest.raises(AdapterMismatch, match=r"^\S+/b: not a PEFT adapter folder \(want adapter_config"):
        read_peft(tmp_path / "b")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_fingerprint_equals_the_learners(tok, tmp_path, dtype):
    """The vLLM sampler hashes the checkpoint's files as the learner hashes its float32 model of them."""
    build_tiny_model(tok, seed=5).to(dtype).save_pretrained(tmp_path)
    learner_side = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).to(torch.float32)
    _, tied = checkpoint_layout(str(tmp_path))
    sampler_side = fingerprint_of(checkpoint_samples(str(tmp_path), tied))
    assert tied and sampler_side == lora.base_fingerprint(learner_side)
    other = lora.base_fingerprint(build_tiny_model(tok, seed=6))
    assert sampler_side != other


class FakeEngine:
    """AsyncLLM's LoRA calls: every worker answers `ack` to add_lora."""

    def __init__(self, ack=True):
        self.ack, self.loras, self.removed = ack, set(), []

    async def add_lora(self, req):
        if self.ack:
            self.loras.add(req.lora_int_id)
        return self.ack

    async def remove_lora(self, lora_id):
        self.removed.append(lora_id)
        return self.loras.discard(lora_id) is None


def test_adapters_are_released_after_their_last_request_and_counted_only_when_loaded(tok, tmp_path):
    pytest.importorskip("vllm")  # vllm.lora.request.LoRARequest
    build_tiny_model(tok, seed=5).save_pretrained(tmp_path / "base")
    shapes, tied = checkpoint_layout(str(tmp_path / "base"))
    adapters, engine = VLLMAdapters(str(tmp_path / "base"), shapes, tied, max_rank=8), FakeEngine()
    adapter = lora.adapter_weights(adapted(tok), torch.float32)

    async def scenario():
        await adapters.load(engine, adapters.stage(adapter), version=1)
        turn = adapters.acquire()  # a turn started under version 1
        await adapters.load(engine, adapters.stage(adapter), version=2)
        kept = (set(engine.loras), list(engine.removed))
        await adapters.done(engine, turn)  # its last request ends: version 1 goes
        return turn, kept

    turn, kept = asyncio.run(scenario())
    assert turn.lora_name == "v1.1" and adapters.current.lora_name == "v2.2"  # v{version}.{unique id}
    assert kept == ({1, 2}, []) and engine.loras == {2} and engine.removed == [1]
    assert not Path(turn.lora_path).exists() and set(adapters.loaded) == {2}
    refused = FakeEngine(ack=False)  # a worker did not load it: not this sampler's version
    staged = adapters.stage(adapter)
    with pytest.raises(RuntimeError, match=r"^vLLM did not load LoRA adapter v3\.3 \(version 3\)$"):
        asyncio.run(adapters.load(refused, staged, version=3))
    assert adapters.current.lora_name == "v2.2" and not staged.folder.exists()
    no_lora = VLLMAdapters(str(tmp_path / "base"), shapes, tied, max_rank=0)
    with pytest.raises(
        AdapterMismatch, match=r"^LoRA adapter refused: this vLLM sampler's engine was started"
    ):
        no_lora.stage(adapter)
    small = adapter_message(dict(adapter), 2.0, 16, adapter.meta["base_fingerprint"])  # rank 16 > 8
    with pytest.raises(AdapterMismatch, match=r"^LoRA adapter refused: rank 16 is above .* max_lora_rank 8$"):
        adapters.stage(small)
    adapters.close()
    assert lora_engine_args(4) == {
        "enable_lora": True,
        "max_lora_rank": 8,
        "max_loras": 2,
        "max_cpu_loras": 3,
    }
    assert lora_engine_args(0) == {}  # the smallest vLLM max_lora_rank >= 4 is 8


@pytest.mark.parametrize("adapter_out", [False, True])
def test_export_of_a_lora_run_writes_the_merged_model_and_a_peft_adapter(tok, tmp_path, adapter_out, capsys):
    cfg = config(learner={"minibatches": 1, "lora": {"rank": RANK, "alpha": ALPHA}})
    learner = Learner(adapted(tok), cfg)
    learner.step(make_trees(tok, seed=12))
    learner.save(tmp_path / "run", step=1, tokenizer=tok)
    (tmp_path / "run" / "config.yaml").write_text("model:\n  path: /models/tiny\n")
    args = ["export", str(tmp_path / "run"), str(tmp_path / "hf")]
    if adapter_out:
        args += ["--adapter-out", str(tmp_path / "peft")]
    assert main(args) == 0
    folder = tmp_path / ("peft" if adapter_out else "hf/adapter")
    assert f"LoRA adapter (PEFT format, base /models/tiny) in {folder}" in capsys.readouterr().out
    assert (tmp_path / "hf" / "adapter").exists() is not adapter_out
    tensors, meta = read_peft(folder)
    live = lora.adapter_state(learner.model)
    assert tensors.keys() == live.keys() and all(torch.equal(tensors[k], live[k]) for k in live)  # fp32
    assert (meta["rank"], meta["alpha"], meta["scaling"], meta["base_model"]) == (4, 8.0, 2.0, "/models/tiny")
    assert meta["base_fingerprint"] == lora.base_fingerprint(learner.model)
    ids = tok.encode("the quick brown fox jumps over the lazy dog and back again")
    want = logprobs(learner.model.eval(), ids)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert float((logprobs(exported, ids) - want).abs().max()) <= 1e-5  # the merged folder
    base = build_tiny_model(tok, seed=5).eval()  # the adapter over its base (the HF sampler's merge)
    AdapterMerge().apply(
        base, adapter_message(tensors, meta["scaling"], meta["rank"], meta["base_fingerprint"])
    )
    assert float((logprobs(base, ids) - want).abs().max()) <= 1e-5
