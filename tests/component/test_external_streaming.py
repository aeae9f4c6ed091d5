"""`stream=true` (issue 47, next step b): the turn comes back as OpenAI's server-sent events, which the
openai client assembles into the message it sends back; what is stored is exactly what the same harness
stores without streaming (same tokens, log-probs, observations, rewards)."""

import json

import httpx
import numpy as np
import openai
import pytest

from tests.external_fixtures import ToolScript, external_sampler, kb_setup


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


def assembled(stream):
    """The assistant message (as `model_dump(exclude_none=True)` gives it), the finish reason, the
    log-probs and the `treeopsd` record of a streamed reply."""
    content, calls, finish, lps, extra = "", {}, None, [], None
    for chunk in stream:
        extra = getattr(chunk, "treeopsd", None) or extra
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for c in delta.tool_calls or []:
                calls[c.index] = {"id": c.id, "type": "function", "function": c.function.model_dump()}
            if choice.logprobs is not None:
                lps += [x.logprob for x in choice.logprobs.content]
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {k: v for k, v in message.items() if v is not None}, finish, lps, extra


def harness_for(stream, seen):
    """The example's loop, streamed or not; keeps per session each reply's message and log-probs."""

    def run(task, base_url, session):
        c = openai.OpenAI(base_url=base_url, api_key=task["api_key"])
        msgs = [
            {"role": "system", "content": task["system_prompt"]},
            {"role": "user", "content": task["question"]},
        ]
        for _ in range(4):
            args = {"model": "m", "messages": msgs, "tools": task["tools"], "logprobs": True}
            if stream:
                r = c.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
                msg, finish, lps, extra = assembled(r)
            else:
                r = c.chat.completions.create(**args)
                msg, finish = r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason
                lps, extra = [x.logprob for x in r.choices[0].logprobs.content], r.treeopsd
            seen.setdefault(session, []).append((finish, lps, extra["token_ids"]))
            msgs.append(msg)
            call = msg["tool_calls"][0]
            called = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "answer":
                return float(called["answer"] in task["answers"])
            result = task["call_tool"]("search", called)
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return 0.0

    return run


def stored(tree):
    """What a tree holds per node (a reward only on leaves: NaN elsewhere, here None)."""
    nodes = [
        (n.tokens.tolist(), n.behavior_logprobs.tolist(), n.obs_tokens.tolist(), n.reward)
        for n in tree.nodes[1:]
    ]
    nodes = [(*n[:3], None if np.isnan(n[3]) else n[3]) for n in nodes]
    return tree.prompt_tokens.tolist(), tree.parents.tolist(), nodes


def test_streamed_replies_store_what_the_non_streamed_ones_store(kb):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=2)
    out = {}
    for stream in (False, True):
        seen = {}
        sampler = external_sampler(
            ToolScript(tok, tasks), env, protocol, harness_for(stream, seen), shape=(2, 1)
        )
        try:
            trees = sampler.sample_trees(tasks, np.random.default_rng(0), ["t0", "t1"])
        finally:
            sampler.close()
        out[stream] = ([stored(t) for t in trees], seen, sampler.external.stats)
    (plain, plain_seen, plain_stats), (streamed, streamed_seen, streamed_stats) = out[False], out[True]
    assert [len(t[2]) for t in plain] == [6, 6]  # 2 trunks × 2 turns + 2 branches × 1 fresh turn per tree
    assert streamed == plain  # the same tokens, log-probs, observations, parents and rewards
    assert streamed_seen == plain_seen  # the same finish reasons, log-probs and token ids came back
    assert streamed_stats["external/episodes_stored"] == plain_stats["external/episodes_stored"] == 8
    assert "external/context_mismatch" not in streamed_stats  # every assembled reply extended the record


def test_the_events_are_openai_chunks_then_done(kb):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=1)
    got = {}

    def harness(task, base_url, session):
        body = {"messages": [{"role": "user", "content": task["question"]}], "stream": True}
        got["r"] = httpx.post(
            f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {task['api_key']}"}
        )
        return 1.0

    sampler = external_sampler(ToolScript(tok, tasks), env, protocol, harness, shape=(1, 0))
    try:
        sampler.sample_trees(tasks, np.random.default_rng(0), ["e0"])
    finally:
        sampler.close()
    r = got["r"]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    # role; the search call (its content is empty, no logprobs asked: no content chunk); the finish
    assert [sorted(d) for d in deltas] == [["content", "role"], ["tool_calls"], []]
    assert deltas[1]["tool_calls"][0]["function"]["name"] == "search"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "tool_calls"]
    assert chunks[-1]["treeopsd"]["session"] == "e0/m0"
