"""HFBackend: token-in/token-out sampling with a KV cache kept across turns (system/policy.py contract)."""

from __future__ import annotations

import math

import pytest
import torch

from actors.policy.hf_backend import HFBackend
from actors.policy.tiny_model import build_tiny_model, build_tokenizer
from system.policy import SampleRequest, SamplingConfig
from system.sampling import sampling_logprobs

TEXTS = ["The mentor of Tavo Mirel is Quinto Sar.", "search: Tavo Mirel mentor", "answer: Quinto"] * 30
EOS = 2


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TEXTS, vocab_size=256)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, seed=0)


def backend(model, tok, **cfg) -> HFBackend:
    return HFBackend(model, tok, sampling=SamplingConfig(**{"seed": 7, **cfg}))


def ctx(tok, text="search: Tavo Mirel mentor") -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_length_finish_and_mid_sequence_stop(model, tok):
    c = ctx(tok)
    [free] = backend(model, tok).sample([SampleRequest(c, 12)])
    assert free.finish_reason == "length" and len(free.token_ids) == 12 == len(free.logprobs)
    # Same seed, same draws: stopping on the token sampled at position k ends the turn right there.
    k = next(i for i in range(3, 12) if free.token_ids[i] not in free.token_ids[:i])
    [stopped] = backend(model, tok).sample([SampleRequest(c, 12, (free.token_ids[k],))])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: k + 1]  # the stop token is included
    assert stopped.logprobs == pytest.approx(free.logprobs[: k + 1], abs=1e-6)


def test_every_token_a_stop_token_stops_at_once(model, tok):
    [r] = backend(model, tok).sample([SampleRequest(ctx(tok), 5, tuple(range(len(tok))))])
    assert r.finish_reason == "stop" and len(r.token_ids) == 1


def test_zero_new_tokens(model, tok):
    [r] = backend(model, tok).sample([SampleRequest(ctx(tok), 0)])
    assert (r.token_ids, r.logprobs, r.finish_reason) == ([], [], "length")


def test_seeded_determinism(model, tok):
    reqs = [SampleRequest(ctx(tok), 16), SampleRequest(ctx(tok, "answer: Quinto"), 16)]
    a, b = backend(model, tok).sample(reqs), backend(model, tok).sample(reqs)
    c = backend(model, tok, seed=8).sample(reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_cached_continuation_equals_full_prefill(model, tok):
    cached, fresh = (
        backend(model, tok),
        backend(model, tok),
    )  # same seed: same uniform draws in the same order
    c1 = ctx(tok)
    [a1] = cached.sample([SampleRequest(c1, 10, cache_key="ep")])
    [b1] = fresh.sample([SampleRequest(c1, 10)])
    assert a1.token_ids == b1.token_ids and a1.cached_prefix_tokens == 0
    c2 = c1 + a1.token_ids + ctx(tok, "\nThe mentor of Tavo Mirel is Quinto Sar.\n")
    [a2] = cached.sample([SampleRequest(c2, 10, cache_key="ep", parent_key="ep")])
    [b2] = fresh.sample([SampleRequest(c2, 10)])
    # The last sampled token of turn 1 was never fed, so the cache holds len(c1) + 10 - 1 tokens.
    assert a2.cached_prefix_tokens == len(c1) + 9 and b2.cached_prefix_tokens == 0
    assert a2.info["prefill_tokens"] == len(c2) - a2.cached_prefix_tokens
    assert a2.token_ids == b2.token_ids
    assert a2.logprobs == pytest.approx(b2.logprobs, abs=1e-5)


def test_branch_from_cropped_cache_equals_fresh_prefill(model, tok):
    cached, fresh = backend(model, tok), backend(model, tok)
    c1 = ctx(tok)
    for b in (cached, fresh):
        [r1] = b.sample([SampleRequest(c1, 10, cache_key="anchor")])
    anchor = c1 + r1.token_ids[:4]  # branch after the 4th sampled token (the cache diverges after it)
    branch = [*anchor, *ctx(tok, " Quinto")]
    [a] = cached.sample([SampleRequest(branch, 8, cache_key="b1", parent_key="anchor")])
    [b] = fresh.sample([SampleRequest(branch, 8)])
    assert a.cached_prefix_tokens == len(anchor)
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # The anchor's stored cache was not mutated by the branch: extending it still matches a fresh prefill.
    full = c1 + r1.token_ids + [EOS]
    [a] = cached.sample([SampleRequest(full, 6, parent_key="anchor")])
    [b] = fresh.sample([SampleRequest(full, 6)])
    assert a.cached_prefix_tokens == len(c1) + 9
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_in_place_branch_under_the_same_key(model, tok):
    # parent_key == cache_key takes the no-copy path; cropping it to a shorter common prefix must still
    # equal a fresh prefill.
    cached, fresh = backend(model, tok), backend(model, tok)
    c = ctx(tok)
    for b in (cached, fresh):
        b.sample([SampleRequest(c, 6, cache_key="s")])
    branch = [*c[:3], *ctx(tok, "answer: Quinto")]
    [a] = cached.sample([SampleRequest(branch, 6, cache_key="s", parent_key="s")])
    [b] = fresh.sample([SampleRequest(branch, 6)])
    assert a.cached_prefix_tokens == 3
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert cached.cached_sessions == 1


def test_cache_reuse_edge_cases(model, tok):
    b = HFBackend(model, tok, max_cached_sessions=2)
    c = ctx(tok)
    b.sample([SampleRequest(c, 0, cache_key="k")])  # stores exactly the context
    [same] = b.sample([SampleRequest(c, 3, parent_key="k")])
    assert same.cached_prefix_tokens == len(c) - 1  # one token must be fed to get logits
    [other] = b.sample([SampleRequest(ctx(tok, "answer: Quinto"), 3, parent_key="k")])
    assert other.cached_prefix_tokens == 0  # no common prefix: full prefill
    [unknown] = b.sample([SampleRequest(c, 3, parent_key="nope")])
    assert unknown.cached_prefix_tokens == 0
    b.sample([SampleRequest(c, 0, cache_key="x")])
    b.sample([SampleRequest(c, 0, cache_key="y")])  # LRU bound 2: "k" is evicted
    assert b.cached_sessions == 2
    [evicted] = b.sample([SampleRequest([*c, 5], 3, parent_key="k")])
    assert evicted.cached_prefix_tokens == 0
    b.evict("x", "y")
    assert b.cached_sessions == 0


@pytest.mark.parametrize(
    "cfg",
    [{}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.3, "top_k": 20}, {"temperature": 0}],
)
def test_score_reproduces_sampled_logprobs(model, tok, cfg):
    # Token-in/token-out acceptance: re-scoring the sampled ids in one forward pass gives the same numbers.
    b = backend(model, tok, **cfg)
    c1 = ctx(tok)
    [r1] = b.sample([SampleRequest(c1, 20, cache_key="e")])
    c2 = c1 + r1.token_ids + ctx(tok, "\nobs\n")
    [r2] = b.sample([SampleRequest(c2, 20, cache_key="e", parent_key="e")])
    assert r2.cached_prefix_tokens > 0
    for context, res in ((c1, r1), (c2, r2)):
        scored = b.score(context + res.token_ids, len(context))
        assert max(abs(x - y) for x, y in zip(scored, res.logprobs, strict=True)) < 1e-5


def test_greedy_reports_model_logprobs(model, tok):
    c = ctx(tok)
    [r] = backend(model, tok, temperature=0).sample([SampleRequest(c, 1)])
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([c])).logits[0, -1].float(), -1)
    assert r.token_ids == [int(lp.argmax())]
    assert r.logprobs[0] == pytest.approx(float(lp.max()), abs=1e-6)


def test_sampling_logprobs_hand_worked():
    # probs (0.5, 0.3, 0.15, 0.05); top_p 0.7 keeps the head whose mass first reaches 0.7: {0.5, 0.3}
    # -> renormalized 0.5/0.8 = 0.625 and 0.3/0.8 = 0.375.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    lp = sampling_logprobs(logits, SamplingConfig(top_p=0.7))
    assert lp[:2].exp().tolist() == pytest.approx([0.625, 0.375])
    assert torch.isinf(lp[2:]).all()
    # top_k 3 drops 0.05 -> 0.5/0.95, 0.3/0.95, 0.15/0.95
    lp = sampling_logprobs(logits, SamplingConfig(top_k=3))
    assert lp[:3].exp().tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95])
    # temperature 2: p ∝ sqrt(p) -> sqrt(.5)/Σ sqrt = 0.7071/(0.7071+0.5477+0.3873+0.2236) = 0.3790
    lp = sampling_logprobs(logits, SamplingConfig(temperature=2.0))
    assert math.exp(float(lp[0])) == pytest.approx(0.3790, abs=1e-4)


def test_samples_follow_the_reported_distribution(model, tok):
    # 2000 one-token draws with top_k 4: empirical frequencies match exp(log-prob) within 4 sigma.
    b = backend(model, tok, top_k=4)
    c = ctx(tok)
    res = b.sample([SampleRequest(c, 1)] * 2000)
    probs = {r.token_ids[0]: math.exp(r.logprobs[0]) for r in res}
    assert len(probs) == 4 and sum(probs.values()) == pytest.approx(1.0, abs=1e-5)
    for t, p in probs.items():
        freq = sum(r.token_ids[0] == t for r in res) / len(res)
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / len(res))


def test_load_weights_changes_outputs_and_validates(tok):
    m = build_tiny_model(tok, seed=0)
    b = HFBackend(m, tok, sampling=SamplingConfig(seed=0))
    c = ctx(tok)
    b.sample([SampleRequest(c, 0, cache_key="k")])
    before = b.score(c, 1)
    new = {n: t.clone() for n, t in build_tiny_model(tok, seed=1).state_dict().items()}
    b.load_weights(new, version=3)
    assert b.version == 3 and b.cached_sessions == 0  # stale K/V dropped
    after = b.score(c, 1)
    assert max(abs(x - y) for x, y in zip(before, after, strict=True)) > 1e-3
    [r] = b.sample([SampleRequest(c, 2)])
    assert r.info["version"] == 3
    w = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="shape mismatch"):
        b.load_weights({w: torch.zeros(3, 3)}, version=4)
    with pytest.raises(ValueError, match="unknown names"):
        b.load_weights({"model.not_a_layer.weight": torch.zeros(1)}, version=4)
    assert b.version == 3 and b.score(c, 1) == after  # nothing was copied by the failed calls


def test_load_weights_partial_and_dtype_cast(tok):
    m = build_tiny_model(tok, seed=0)
    b = HFBackend(m, tok)
    w = "model.norm.weight"
    b.load_weights({w: torch.full_like(m.state_dict()[w], 2.0, dtype=torch.bfloat16)}, version=1)
    assert m.state_dict()[w].dtype == torch.float32 and torch.all(m.state_dict()[w] == 2.0)


def test_loads_from_a_folder(tmp_path, model, tok):
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    b = HFBackend(tmp_path, sampling=SamplingConfig(seed=0, temperature=0))
    ref = HFBackend(model, tok, sampling=SamplingConfig(seed=0, temperature=0))
    [x], [y] = b.sample([SampleRequest(ctx(tok), 8)]), ref.sample([SampleRequest(ctx(tok), 8)])
    assert x.token_ids == y.token_ids and b.tokenizer is not None
    b.close()
