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
    same(a, b, cache_rows=[0])
    # one context: row 0 prefills it, rows 1 and 2 copy its K/V (all but the last token count as served)
    assert [r.cached_prefix_tokens for r in a] == [0, len(c) - 1, len(c) - 1]
    assert [len(r.token_ids) for r in a] == [0, 1, 3] and [r.finish_reason for r in a] == [
        "length",
        "stop",
        "length",
    ]


def test_suffix_groups_bound_the_padding():
    from actors.policy.hf_batch import suffix_groups

    # 70-token prompts and 400-token observations: two groups, no pads in either.
    assert suffix_groups([400, 70, 400, 70]) == [[1, 3], [0, 2]]
    # 10, 11, 12: 3 x 12 = 36 padded <= 1.25 x 33 real; a fourth of 40 would pad 4 x 40 = 160 > 1.25 x 73.
    assert suffix_groups([12, 40, 10, 11]) == [[2, 3, 0], [1]]
    assert suffix_groups([1, 1, 1]) == [[0, 1, 2]] and suffix_groups([]) == []


def test_rows_of_very_different_lengths_prefill_in_groups_and_match_one_at_a_time(model, tok):
    from actors.policy import hf_batch

    batched, single = pair(model, tok, temperature=0.8)
    long_text = " ".join(TEXTS[:12])
    texts = ["answer: Quinto", long_text, "search: Tavo", long_text + " The mentor"]
    contexts = [tok.encode(t, add_special_tokens=False) for t in texts]
    assert len(hf_batch.suffix_groups([len(c) for c in contexts])) == 2  # short rows, long rows
    first = [SampleRequest(c, 6, cache_key=f"e{i}") for i, c in enumerate(contexts)]
    a1, b1 = batched.sample(first), single.sample(first)
    same(a1, b1)
    # Turn 2 extends every cache: a long observation after two rows, one token after the others.
    obs = tok.encode(" " + " ".join(TEXTS[:6]), add_special_tokens=False)
    tails = [obs, obs[:1], obs, obs[:1]]
    second = [
        SampleRequest([*c, *r.token_ids, *t], 5, cache_key=f"e{i}", parent_key=f"e{i}")
        for i, (c, r, t) in enumerate(zip(contexts, a1, tails, strict=True))
    ]
    a2, b2 = batched.sample(second), single.sample(second)
    same(a2, b2)
    # the stored caches continue exactly: a third turn after each still matches
    third = [
        SampleRequest([*q.context, *r.token_ids, *obs[:2]], 3, cache_key=f"e{i}", parent_key=f"e{i}")
        for i, (q, r) in enumerate(zip(second, a2, strict=True))
    ]
    same(batched.sample(third), single.sample(third))


def test_twins_prefill_once_draw_apart_and_ended_rows_leave_the_batch(model, tok, monkeypatch):
    """Eight rows, four contexts twice each (a question's samples): each context is prefilled once, every
    row draws with its own generator; three rows end after one token, so the batch shrinks (a quarter
    ended) and their caches are cut out then. Turn 2 continues every stored cache: still one at a time's."""
    batched, single = pair(model, tok, temperature=1.0)
    texts = ["search: Tavo Mirel mentor", "answer: Quinto", "The mentor of", "search: Quinto"]
    contexts = [tok.encode(t, add_special_tokens=False) for t in texts] * 2
    limits = [1, 6, 1, 6, 6, 1, 6, 6]
    first = [
        SampleRequest(c, n, cache_key=f"e{i}") for i, (c, n) in enumerate(zip(contexts, limits, strict=True))
    ]
    from actors.policy import hf_batch

    taken = []
    real_take = hf_batch.take_rows
    monkeypatch.setattr(
        hf_batch, "take_rows", lambda st, rows, cfg: taken.append(rows) or real_take(st, rows, cfg)
    )
    a1, b1 = batched.sample(first), single.sample(first)
    same(a1, b1, cache_rows=range(4))  # each row's tokens are one at a time's: its own draws
    assert [r.cached_prefix_tokens for r in a1[4:]] == [len(c) - 1 for c in contexts[4:]]  # the twins
    # the four prefilled rows copied into eight, then the five rows still decoding kept
    assert taken == [[0, 1, 2, 3, 0, 1, 2, 3], [1, 3, 4, 6, 7]]
    obs = tok.encode(" Sar.", add_special_tokens=False)
    second = [
        SampleRequest([*c, *r.token_ids, *obs], 4, cache_key=f"e{i}", parent_key=f"e{i}")
        for i, (c, r) in enumerate(zip(contexts, a1, strict=True))
    ]
    a2, b2 = batched.sample(second), single.sample(second)
    same(a2, b2)  # the same cached prefixes: every stored cache held its context and its fed tokens
