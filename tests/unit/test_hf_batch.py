"""The HF backend's lock-step batch gives what one request at a time gives: the same ids, the same log-probs
(to float rounding of the batched matmuls), the same finish reasons and the same per-episode caches, with
parents reused, branches cropped and rows of different lengths and limits in one call."""

from __future__ import annotations

import pytest

from actors.policy.hf_backend import HFBackend
from actors.policy.tiny_model import build_tiny_model, build_tokenizer
from system.policy import SampleRequest, SamplingConfig

TEXTS = ["The mentor of Tavo Mirel is Quinto Sar.", "search: Tavo Mirel mentor", "answer: Quinto"] * 30


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TEXTS, vocab_size=256)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, seed=0)


def pair(model, tok, **sampling):
    spec = SamplingConfig(**{"seed": 11, **sampling})
    return HFBackend(model, tok, sampling=spec, batch=True), HFBackend(model, tok, sampling=spec, batch=False)


def same(a, b, cache_rows=None) -> None:
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]
    rows = range(len(a)) if cache_rows is None else cache_rows
    assert [a[i].cached_prefix_tokens for i in rows] == [b[i].cached_prefix_tokens for i in rows]
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.0}])
def test_lockstep_batch_equals_one_at_a_time_over_two_turns(model, tok, sampling):
    batched, single = pair(model, tok, **sampling)
    texts = ["search: Tavo Mirel mentor", "answer: Quinto", "The mentor of", "search: Quinto"]
    contexts = [tok.encode(t, add_special_tokens=False) for t in texts]
    limits = [12, 5, 9, 1]  # different lengths and limits in one call
    stop = (tok.encode(".", add_special_tokens=False)[0],)
    first = [
        SampleRequest(c, n, stop, cache_key=f"e{i}")
        for i, (c, n) in enumerate(zip(contexts, limits, strict=True))
    ]
    a1, b1 = batched.sample(first), single.sample(first)
    same(a1, b1)
    # Turn 2: each episode extends its own cache; episode 3 branches off episode 0 after 2 tokens.
    obs = tok.encode(" Sar.", add_special_tokens=False)
    second = [
        SampleRequest([*c, *r.token_ids, *obs], 8, stop, cache_key=f"e{i}", parent_key=f"e{i}")
        for i, (c, r) in enumerate(zip(contexts[:3], a1[:3], strict=True))
    ]
    second.append(
        SampleRequest([*contexts[0], *a1[0].token_ids[:2], *obs], 6, stop, cache_key="b", parent_key="e0")
    )
    a2, b2 = batched.sample(second), single.sample(second)
    # The branch reads e0 as stored before the call in a batch, but e0 as just extended one at a time: a
    # different amount of reused prefix (both exact K/V), the same tokens and log-probs.
    same(a2, b2, cache_rows=[0, 1, 2])
    assert all(r.cached_prefix_tokens > 0 for r in a2)  # every row reused a cache
    assert batched.cached_sessions == single.cached_sessions == 5


def test_zero_new_tokens_and_an_immediate_stop_in_a_batch(model, tok):
    batched, single = pair(model, tok)
    c = tok.encode("answer: Quinto", add_special_tokens=False)
    every = tuple(range(len(tok)))  # any token stops
    reqs = [SampleRequest(c, 0), SampleRequest(c, 4, every), SampleRequest(c, 3)]
    a, b = batched.sample(reqs), single.sample(reqs)
    same(a, b)
    assert [len(r.token_ids) for r in a] == [0, 1, 3] and [r.finish_reason for r in a] == [
        "length",
        "stop",
        "length",
    ]
