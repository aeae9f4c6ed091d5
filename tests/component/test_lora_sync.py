"""Adapter-only weight sync (system/lora_sync.py, learner/lora.py, actors/policy/hf_lora.py) on the tiny Qwen2
model: a LoRA learner publishes lora_A/lora_B alone over the ZeroMQ broadcast, and the HF sampler that merges
them scores as the merged model does (reference: a plain model loaded with the learner's merged weights,
built here); a second version replaces the first; an adapter of another base is refused in one line and not
counted as applied; the bytes are exactly the adapter's; vLLM samplers get adapters too (merged weights with
`sampler.engine.enable_lora: false`)."""

import asyncio

import pytest
import torch
from learner_fixtures import config

from actors.policy.hf_backend import HFBackend
from actors.policy.tiny_model import build_tiny_model
from actors.turn_server import as_turn_server
from actors.weight_gate import load_version
from actors.weight_subscriber import WeightSubscriber
from learner import lora
from learner.learner import Learner
from learner.weight_publisher import WeightPublisher
from system.lora_sync import AdapterMismatch, is_adapter
from system.weight_channel import InMemoryWeightChannel

torch.set_num_threads(1)
RANK, ALPHA = 4, 8.0
WAIT_MS = 30_000


def lora_learner(tok, seed=3, weights=None, backend="hf"):
    adapters = {"rank": RANK, "alpha": ALPHA}
    cfg = config(learner={"lora": adapters}, sampler={"backend": backend}, weights={"dtype": "float32"})
    return Learner(build_tiny_model(tok, seed=seed), cfg, weights=weights)


def train_adapter(learner, seed):
    """A and B set away from their init, seeded (what some LoRA steps would do), then published."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.lora_layers(learner.model).values():
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen) * 0.2)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.2)
    learner.version += 1
    learner._publish()


def reference(tok, learner):
    """A plain HF sampler holding the learner's merged weights (the full-weights path)."""
    ref = HFBackend(build_tiny_model(tok, seed=99), tokenizer=tok)
    ref.load_weights(learner.named_weights(), version=learner.version)
    return ref


def context(tok):
    return tok.encode("the quick brown fox jumps over the lazy dog and back again")


def gap(a, b, ids):
    return max(abs(x - y) for x, y in zip(a.score(ids, 1), b.score(ids, 1), strict=True))


@pytest.mark.parametrize("transport", ["auto", "tcp"])  # the sealed memfd, and chunks over the socket
def test_adapter_publish_matches_the_merged_model_and_replaces(tok, transport):
    with WeightPublisher(chunk_mb=1 / 64) as pub, WeightSubscriber(pub.endpoint, transport=transport) as sub:
        learner = lora_learner(tok, weights=pub)
        learner.start()  # version 0: the adapter with B = 0
        sampler = HFBackend(build_tiny_model(tok, seed=3), tokenizer=tok)
        base = HFBackend(build_tiny_model(tok, seed=3), tokenizer=tok)
        ids = context(tok)
        v0 = sub.poll(WAIT_MS)
        assert v0 is not None and v0[0] == 0 and is_adapter(v0[1]), v0
        assert v0[1].meta["scaling"] == ALPHA / RANK and v0[1].meta["rank"] == RANK
        sampler.load_weights(v0[1], version=0)
        assert gap(sampler, base, ids) == 0.0  # B = 0: the base exactly
        q = "model.layers.0.self_attn.q_proj"
        w_base = dict(base.model.named_parameters())[f"{q}.weight"].detach()
        steps = {}  # seed -> (gap to the merged reference, gap to the base, scale·B·A of q_proj)
        for seed in (1, 2):
            train_adapter(learner, seed)
            got = sub.poll(WAIT_MS)
            assert (
                got is not None
                and got[0] == learner.version
                and set(got[1]) == set(lora.adapter_state(learner.model))
            )
            sampler.load_weights(got[1], version=got[0])
            ref = reference(tok, learner)
            layer = lora.lora_layers(learner.model)[q]
            delta = (layer.lora_B @ layer.lora_A).detach() * layer.scaling  # this version's scale·B·A
            steps[seed] = (gap(sampler, ref, ids), gap(sampler, base, ids), delta)
        w = dict(sampler.model.named_parameters())[f"{q}.weight"].detach()
        assert torch.equal(w, w_base + steps[2][2])  # v2 replaced v1: base + its own B·A
        assert (w - (w_base + steps[1][2] + steps[2][2])).abs().max() > 1e-3  # not accumulated
        assert max(steps[1][0], steps[2][0]) <= 1e-5, steps  # the merged model's log-probs
        assert min(steps[1][1], steps[2][1]) > 1e-3, steps  # and not the base's
        assert sampler.version == 2 and sub.stats()["transport"] == ("shm" if transport == "auto" else "tcp")


def test_an_adapter_of_another_base_is_refused_in_one_line_and_not_counted(tok):
    channel = InMemoryWeightChannel()
    learner = lora_learner(tok, weights=channel)
    train_adapter(learner, seed=1)
    version, adapter = channel.poll()
    foreign = HFBackend(build_tiny_model(tok, seed=6), tokenizer=tok)
    before = {n: p.detach().clone() for n, p in foreign.model.named_parameters()}
    stats: dict[str, float] = {}
    with pytest.raises(AdapterMismatch) as err:
        asyncio.run(load_version(as_turn_server(foreign), version, adapter, stats))
    message = str(err.value)
    assert "\n" not in message and "trained on another base model" in message, message
    assert foreign.version == 0 and "weights/applied" not in stats  # not applied, not counted
    assert all(torch.equal(p, before[n]) for n, p in foreign.model.named_parameters())  # untouched
    own = HFBackend(build_tiny_model(tok, seed=3), tokenizer=tok)
    asyncio.run(load_version(as_turn_server(own), version, adapter, stats))
    assert own.version == version == 1 and stats["weights/applied"] == 1.0


def test_adapter_bytes_are_exactly_the_adapters(tok):
    with WeightPublisher() as pub, WeightSubscriber(pub.endpoint) as sub:
        learner = lora_learner(tok, weights=pub)
        learner.start()
        got = sub.poll(WAIT_MS)
        adapter_bytes = pub.stats()["payload_bytes"]
        # per layer, rank 4, fp32: A [4, in] + B [out, 4] over q, k, v, o (64→64, 64→32, 64→32, 64→64) and
        # gate, up, down (64→256, 64→256, 256→64); every tensor a multiple of 64 bytes: no padding
        per_layer = RANK * 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 256) * 3)
        assert adapter_bytes == sub.stats()["bytes"] == 2 * per_layer == 45_056
        assert got is not None and len(got[1]) == 2 * 7 * 2
    with WeightPublisher() as full_pub:
        full_pub.publish(learner.named_weights(), 0)
        full_bytes = full_pub.stats()["payload_bytes"]
    assert full_bytes > 10 * adapter_bytes, (full_bytes, adapter_bytes)


def test_vllm_samplers_get_adapters_unless_engine_lora_is_off(tok):
    channel = InMemoryWeightChannel()
    learner = lora_learner(tok, weights=channel, backend="vllm")  # loaded as vLLM LoRA adapters
    learner.start()
    _, weights = channel.poll()
    assert is_adapter(weights) and set(weights) == set(lora.adapter_state(learner.model))
    off = {"backend": "vllm", "engine": {"enable_lora": False}}  # the fallback: merged, under base names
    cfg = config(learner={"lora": {"rank": RANK, "alpha": ALPHA}}, sampler=off, weights={"dtype": "float32"})
    channel = InMemoryWeightChannel()
    merged = Learner(build_tiny_model(tok, seed=3), cfg, weights=channel)
    merged.start()
    _, weights = channel.poll()
    assert not is_adapter(weights) and set(weights) == set(merged.named_weights())


def test_fingerprint_samples_stay_inside_large_tensors():
    from system.lora_sync import FINGERPRINT_SAMPLES, sample_indices

    n = 49152 * 576  # SmolLM2 embedding: 28,311,552 > 2**24, where a float32 linspace ended at n
    idx = sample_indices(n)
    assert idx.numel() == FINGERPRINT_SAMPLES and int(idx[0]) == 0 and int(idx[-1]) == n - 1
    assert bool((idx[1:] > idx[:-1]).all())  # strictly increasing: no index read twice
    assert sample_indices(5).tolist() == [0, 1, 2, 3, 4]  # fewer values than samples: each once
    # 4096 samples over 8191 values: stride (8191 - 1) / 4095 = 2 exactly, so 0, 2, 4, ..., 8190
    assert sample_indices(8191).tolist() == list(range(0, 8191, 2))
