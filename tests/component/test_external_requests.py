"""Requests as clients send them (issue 57): a retry is answered from the record (no side call, no second
turn), a hundred identical first requests at once get one answer; a change of tools is refused (409) or,
with env.tool_change=continue, a new context of the episode; the `user` field is accepted and ignored; every
4xx is logged once with its reason and counted by it."""

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from tests.external_fixtures import ToolScript, external_sampler, kb_setup


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


def grow(kb, harness, shape=(1, 0), **limits):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=1)
    backend = ToolScript(tok, tasks)
    sampler = external_sampler(backend, env, protocol, harness, shape=shape, **limits)
    try:
        trees = sampler.sample_trees(tasks, np.random.default_rng(0), ["q0"])
    finally:
        sampler.close()
    return trees, sampler, backend


def start(task):
    return [
        {"role": "system", "content": task["system_prompt"]},
        {"role": "user", "content": task["question"]},
    ]


AT_ONCE = 32


def test_a_retried_request_gets_the_same_answer_and_no_side_call(kb):
    got = {}

    def harness(task, base_url, session):
        body = {"model": "m", "messages": start(task), "tools": task["tools"]}
        key = {"Authorization": f"Bearer {task['api_key']}"}
        with httpx.Client(headers=key, timeout=60) as http, ThreadPoolExecutor(AT_ONCE) as pool:
            post = lambda _: http.post(f"{base_url}/chat/completions", json=body)  # noqa: E731
            first = list(pool.map(post, range(AT_ONCE)))  # identical first requests at once: one answer
        c = openai.OpenAI(base_url=base_url, api_key=task["api_key"])
        msgs = [*start(task), first[0].json()["choices"][0]["message"]]
        msgs.append({"role": "tool", "tool_call_id": msgs[-1]["tool_calls"][0]["id"], "content": "found"})
        answer = c.chat.completions.create(model="m", messages=msgs, tools=task["tools"])
        again = c.chat.completions.create(model="m", messages=msgs, tools=task["tools"])  # a client's retry
        got.update(first=first, answer=answer, again=again)
        return 1.0

    [tree], sampler, backend = grow(kb, harness, shape=(1, 1))
    first = got["first"]
    assert {r.status_code for r in first} == {200}
    records = {json.dumps([r.json()["choices"], r.json()["treeopsd"]]) for r in first}
    assert len(records) == 1  # the same message, tool-call ids, token ids and call index, every time
    a, b = got["answer"], got["again"]
    assert b.choices[0].message == a.choices[0].message and b.treeopsd == a.treeopsd
    # 2 turns per episode sampled (trunk: 2; the branch replays 1, samples 1): no extra turn, no side call
    assert len(backend.results) == 3 and tree.num_leaves == 2
    stats = sampler.external.stats
    assert "external/side_calls" not in stats or stats["external/side_calls"] == 0
    assert stats["external/retries"] == 2 * (AT_ONCE - 1 + 1)  # the trunk's and the branch's (a re-run)
    assert json.loads(tree.meta["calls"])["q0/m0"] == [[0, None], [0, 0]]


def tool_changing(task, base_url, session):
    """One turn with the task's tools, then the next request without them (a final answer forced)."""
    c = openai.OpenAI(base_url=base_url, api_key=task["api_key"])
    r = c.chat.completions.create(model="m", messages=start(task), tools=task["tools"])
    msg = r.choices[0].message.model_dump(exclude_none=True)
    msgs = [*start(task), msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "x"}]
    final = c.chat.completions.create(model="m", messages=msgs)  # no tools: a change of tools
    return float(final.treeopsd["conversation"] == 1)


def test_a_change_of_tools_is_refused_by_default(kb):
    seen = {}

    def harness(task, base_url, session):
        try:
            return tool_changing(task, base_url, session)
        except openai.ConflictError as exc:  # the episode is dropped, not stored with a trunk it never used
            seen[session] = exc
            raise

    trees, sampler, _ = grow(kb, harness)
    refused = seen["q0/m0"]
    assert trees == [] and refused.body["type"] == "tool_change" and refused.body["param"] == "tools"
    assert "env.tool_change=continue" in refused.message
    assert sampler.external.stats["external/tool_changes_refused"] == 1


def test_a_change_of_tools_is_a_new_context_of_the_episode_when_asked(kb, caplog):
    caplog.set_level(logging.INFO, logger="actors.external.turns")
    [tree], sampler, _ = grow(kb, tool_changing, shape=(2, 0), tool_change="continue")
    # the final answer is the episode's second turn, in a new context (a restart), with the episode's reward
    assert tree.num_leaves == 2 and [tree.nodes[i].reward for i in tree.leaves] == [1.0, 1.0]
    assert len(tree.restarts) == 2 and all(len(tree.context_runs(int(leaf))) == 2 for leaf in tree.leaves)
    assert sampler.external.stats["external/tool_changes"] == 2
    assert sum("tools changed" in r.getMessage() for r in caplog.records) == 2


def test_the_user_field_is_accepted_and_ignored_and_4xx_are_logged_once_by_reason(kb, caplog):
    caplog.set_level(logging.DEBUG, logger="actors.external.health")

    def harness(task, base_url, session):
        c = openai.OpenAI(base_url=base_url, api_key=task["api_key"])
        for _ in range(3):  # the same refusal three times: one warning, three counts
            with pytest.raises(openai.BadRequestError):
                c.chat.completions.create(model="m", messages=start(task), temperature=0.3)
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="m", messages=start(task), n=2)
        r = c.chat.completions.create(model="m", messages=start(task), user="alice", tools=task["tools"])
        return float(r.treeopsd["session"] == session)  # `user` named no session: the key did

    [tree], sampler, _ = grow(kb, harness)
    assert tree.nodes[1].reward == 1.0
    errors = {k: v for k, v in sampler.get_metrics().items() if k.startswith("external/errors/")}
    assert errors == {"external/errors/400_bad_temperature": 3.0, "external/errors/400_bad_n": 1.0}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "400_bad_temperature" in warned[0] and "sampler.temperature" in warned[0]
    assert (
        sum("400_bad_temperature" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
        == 3
    )
