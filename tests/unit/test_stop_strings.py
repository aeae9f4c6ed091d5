"""The HF backend stops a turn at a stop token (Qwen3's `</tool_call>` is one) or at the first token whose
text completes a stop string (`</tool_call>` where the vocabulary has no such token), one request at a time
and in lock step; the completing token is kept and nothing after it is sampled. The draws are scripted so
the test does not depend on what a random model would say."""

from __future__ import annotations

import pytest
from protocol_fixtures import chatml_tokenizer, qwen3_tokenizer

from actors.policy.hf_backend import HFBackend
from actors.policy.tiny_model import build_tiny_model
from system.policy import SampleRequest

TURN = 'Let me look.<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n</tool_call> and more text'


def scripted_backend(tok, scripts):
    """HFBackend on a random tiny model whose draws follow `scripts` (one id list per request, in order)."""
    backend = HFBackend(build_tiny_model(tok), tok)
    pending, by_gen = list(scripts), {}

    def draw(lps, generator):
        if id(generator) not in by_gen:
            by_gen[id(generator)] = iter(pending.pop(0))
        return next(by_gen[id(generator)]), -1.0

    backend._draw = draw
    return backend


def first_completion(tok, ids, stop):
    """Index of the first token whose prefix text contains `stop` (hand-checked below)."""
    return next(k for k in range(len(ids)) if stop in tok.decode(ids[: k + 1]))


@pytest.mark.parametrize("batched", [False, True])
def test_stop_token_and_stop_string(batched):
    qtok, ctok = qwen3_tokenizer(), chatml_tokenizer()
    q_ids = qtok.encode(TURN, add_special_tokens=False)
    close = qtok.convert_tokens_to_ids("</tool_call>")
    cut = q_ids.index(close)
    req = SampleRequest([1, 5, 7], 200, stop_token_ids=(qtok.eos_token_id, close))
    reqs = [req, req] if batched else [req]
    out = scripted_backend(qtok, [q_ids] * len(reqs)).sample(reqs)
    for r in out:
        assert r.token_ids == q_ids[: cut + 1] and r.finish_reason == "stop" and len(r.logprobs) == cut + 1
    c_ids = ctok.encode(TURN, add_special_tokens=False)
    assert ctok.convert_tokens_to_ids("</tool_call>") in (None, ctok.unk_token_id, 0)  # no such token here
    k = first_completion(ctok, c_ids, "</tool_call>")
    assert "</tool_call>" in ctok.decode(c_ids[: k + 1]) and "</tool_call>" not in ctok.decode(c_ids[:k])
    sreq = SampleRequest([1, 5, 7], 200, (ctok.eos_token_id,), stop_strings=("</tool_call>", "</search>"))
    reqs = [sreq, SampleRequest([1, 5], len(c_ids), (ctok.eos_token_id,))] if batched else [sreq]
    out = scripted_backend(ctok, [c_ids] * len(reqs)).sample(reqs)
    assert out[0].token_ids == c_ids[: k + 1] and out[0].finish_reason == "stop"
    if batched:  # a request without stop strings in the same call runs to its end
        assert out[1].token_ids == c_ids and out[1].finish_reason == "length"
