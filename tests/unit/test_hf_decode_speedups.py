"""The HF backend's two decode speed-ups change no number: the grouped sdpa attention gives sdpa's outputs
and gradients, and the lock-step cache's in-place layers (`RoomyLayer`) hold what concatenation would."""

from __future__ import annotations

import copy

import pytest
import torch

from actors.policy import hf_batch
from actors.policy.grouped_attention import NAME, use_grouped_attention
from actors.policy.hf_backend import HFBackend
from actors.policy.tiny_model import build_tiny_model, build_tokenizer
from system.policy import SampleRequest, SamplingConfig

TEXTS = ["The mentor of Tavo Mirel is Quinto Sar.", "search: Tavo Mirel mentor", "answer: Quinto"] * 30


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TEXTS, vocab_size=256)


def _loss_and_grads(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    loss = logits.float().square().mean()
    loss.backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_grouped_attention_gives_sdpa_logits_and_gradients(tok):
    sdpa = build_tiny_model(tok, hidden=64, heads=4, kv_heads=2, seed=3).train()
    grouped = copy.deepcopy(sdpa)
    assert sdpa.config._attn_implementation == "sdpa"
    assert use_grouped_attention(grouped) and grouped.config._attn_implementation == NAME
    ids = torch.tensor([tok.encode(t, add_special_tokens=False)[:9] for t in TEXTS[:2]])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row: the masked path, where sdpa would repeat K/V per query head
    want, want_grads = _loss_and_grads(sdpa, ids, mask)
    got, got_grads = _loss_and_grads(grouped, ids, mask)
    assert torch.allclose(got, want, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(g, w, atol=1e-6)


def test_grouped_attention_only_replaces_sdpa_with_fewer_kv_heads(tok):
    assert not use_grouped_attention(build_tiny_model(tok, heads=2, kv_heads=2))  # nothing to group
    eager = build_tiny_model(tok, heads=4, kv_heads=2)
    eager.set_attn_implementation("eager")
    assert not use_grouped_attention(eager) and eager.config._attn_implementation == "eager"


def test_roomy_layer_writes_in_place_and_keeps_earlier_views(monkeypatch):
    monkeypatch.setattr(hf_batch.RoomyLayer, "ROOM", 3)
    torch.manual_seed(0)
    steps = [torch.randn(2, 1, n, 4) for n in (2, 1, 1, 1, 1, 5)]
    layer = hf_batch.RoomyLayer(steps[0], -steps[0])  # buffers of 2 + max(3, 1) = 5 positions
    buffer = layer._k
    seen = [layer.keys]
    for i, new in enumerate(steps[1:], start=1):
        keys, values = layer.update(new, -new)
        whole = torch.cat(steps[: i + 1], dim=-2)
        assert torch.equal(keys, whole) and torch.equal(values, -whole)
        seen.append(keys)
        if i <= 3:  # 2 + 3 positions fit the first buffers: written in place, no copy
            assert layer._k is buffer
    assert layer._k is not buffer and layer.get_seq_length() == 11  # 6 + 5 outgrew them
    for i, view in enumerate(seen):  # what an earlier step read is unchanged by the later writes
        assert torch.equal(view, torch.cat(steps[: i + 1], dim=-2))


def test_lockstep_decode_outgrowing_the_room_matches_one_at_a_time(tok, monkeypatch):
    """Rows decode 40 tokens with room for 4 more at a time: the buffers grow many times mid-decode."""
    monkeypatch.setattr(hf_batch.RoomyLayer, "ROOM", 4)
    model = build_tiny_model(tok, heads=4, kv_heads=2, seed=1)
    spec = SamplingConfig(seed=5, temperature=1.0)
    batched, single = HFBackend(model, tok, sampling=spec), HFBackend(model, tok, sampling=spec, batch=False)
    contexts = [tok.encode(t, add_special_tokens=False) for t in TEXTS[:3]]
    reqs = [SampleRequest(c, 40, cache_key=f"e{i}") for i, c in enumerate(contexts)]
    a, b = batched.sample(reqs), single.sample(reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [len(r.token_ids) for r in a] == [40, 40, 40]  # no stop ids: every row ran its 40 steps
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    # the stored caches (cut out of the grown buffers) continue exactly
    more = [
        SampleRequest([*q.context, *r.token_ids], 5, cache_key=f"e{i}", parent_key=f"e{i}")
        for i, (q, r) in enumerate(zip(reqs, a, strict=True))
    ]
    assert [r.token_ids for r in batched.sample(more)] == [r.token_ids for r in single.sample(more)]
