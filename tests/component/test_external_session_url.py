"""Sessions named by the URL (issue 47, next step a): `task["session_url"]` is
`http://HOST:PORT/s/<session>/v1`, so an unmodified OpenAI client given it needs no header; the episodes
are stored as with the header; a header naming another session is a 400."""

import json

import httpx
import numpy as np
import openai
import pytest

from tests.external_fixtures import ToolScript, external_sampler, kb_setup


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


def plain_client_harness(seen, posted):
    def run(task, base_url, session):
        c = openai.OpenAI(base_url=task["session_url"], api_key=task["api_key"])  # no header, no user
        msgs = [
            {"role": "system", "content": task["system_prompt"]},
            {"role": "user", "content": task["question"]},
        ]
        for _ in range(4):
            r = c.chat.completions.create(model="m", messages=msgs, tools=task["tools"])
            seen.setdefault(session, []).append(r.treeopsd["session"])
            msg = r.choices[0].message
            msgs.append(msg.model_dump(exclude_none=True))
            call = msg.tool_calls[0]
            args = json.loads(call.function.arguments)
            if call.function.name == "answer":
                posted[session] = float(args["answer"] in task["answers"])
                key = {"Authorization": f"Bearer {task['api_key']}"}
                httpx.post(
                    f"{task['session_url']}/reward", json={"reward": posted[session]}, headers=key
                ).raise_for_status()
                return None  # the reward was posted, by the URL too
            msgs.append(
                {"role": "tool", "tool_call_id": call.id, "content": task["call_tool"]("search", args)}
            )
        return 0.0

    return run


def test_an_unmodified_client_names_its_session_by_the_url(kb):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=1)
    seen, posted = {}, {}
    harness = plain_client_harness(seen, posted)
    sampler = external_sampler(ToolScript(tok, tasks), env, protocol, harness, shape=(2, 1))
    try:
        [tree] = sampler.sample_trees(tasks, np.random.default_rng(0), ["u0"])
        url = sampler.external.endpoint.session_url("u0/m0")
    finally:
        sampler.close()
    assert url.endswith("/s/u0%2Fm0/v1")
    # 2 trunks (search, answer) and 2 branches replaying the first turn: each request in its own session
    assert seen == {k: [k, k] for k in ("u0/m0", "u0/m1", "u0/b0", "u0/b1")}
    assert tree.num_leaves == 4 and sampler.external.stats["external/reward_posts"] == 4
    assert sorted(tree.nodes[i].reward for i in tree.leaves) == sorted(posted.values())


def test_a_header_naming_another_session_is_refused(kb):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=1)
    got = {}

    def harness(task, base_url, session):
        body = {"messages": [{"role": "user", "content": task["question"]}]}
        url = f"{task['session_url']}/chat/completions"
        key = {"Authorization": f"Bearer {task['api_key']}"}
        got["other"] = httpx.post(url, json=body, headers={**key, "X-Session-Id": "v0/m9"}, timeout=30)
        got["same"] = httpx.post(url, json=body, headers={**key, "X-Session-Id": session}, timeout=30)
        return 1.0

    sampler = external_sampler(ToolScript(tok, tasks), env, protocol, harness, shape=(1, 0))
    try:
        [tree] = sampler.sample_trees(tasks, np.random.default_rng(0), ["v0"])
    finally:
        sampler.close()
    other = got["other"].json()["error"]
    assert got["other"].status_code == 400 and "'v0/m0'" in other["message"] and "'v0/m9'" in other["message"]
    assert got["same"].status_code == 200 and tree.num_leaves == 1
    assert sampler.get_metrics()["external/rejected_requests"] == 1
