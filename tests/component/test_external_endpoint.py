"""The external-agent endpoint driven by the real `openai` client (issue 40): tool calls round-trip, the
stored ids and log-probs are the engine's, the prompt and observation ids are the project's own loop's, the
HF model re-scores them; bad requests get one OpenAI-style error naming the field; auth off loopback."""

import json

import httpx
import numpy as np
import openai
import pytest
import torch

from actors.external.endpoint import AgentEndpoint
from actors.policy.hf_backend import HFBackend
from actors.policy.tiny_model import build_tiny_model
from system.policy import SamplingConfig
from tests.external_fixtures import ToolScript, external_sampler, kb_setup, worst_rescore_gap


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


def as_stored(ids, logprobs):
    """A turn as the tree stores it: its ids, its log-probs in float32 (system/tree.py)."""
    return tuple(int(i) for i in ids), tuple(np.asarray(logprobs, np.float32).tolist())


def client(base_url, api_key):
    return openai.OpenAI(base_url=base_url, api_key=api_key)


def recording_harness(seen):
    """The example's loop, keeping every response (by session)."""

    def run(task, base_url, session):
        c = client(base_url, task["api_key"])
        msgs = [
            {"role": "system", "content": task["system_prompt"]},
            {"role": "user", "content": task["question"]},
        ]
        for _ in range(4):
            r = c.chat.completions.create(model="m", messages=msgs, tools=task["tools"], logprobs=True)
            seen.setdefault(session, []).append(r)
            msg = r.choices[0].message
            msgs.append(msg.model_dump(exclude_none=True))
            call = msg.tool_calls[0]
            args = json.loads(call.function.arguments)
            if call.function.name == "answer":
                return float(args["answer"] in task["answers"])
            msgs.append(
                {"role": "tool", "tool_call_id": call.id, "content": task["call_tool"]("search", args)}
            )
        return 0.0

    return run


def test_tool_calls_round_trip_and_tokens_are_the_engines(kb):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=2)
    backend, seen = ToolScript(tok, tasks), {}
    sampler = external_sampler(backend, env, protocol, recording_harness(seen), shape=(2, 1))
    try:
        trees = sampler.sample_trees(tasks, np.random.default_rng(0), ["t0", "t1"])
    finally:
        sampler.close()
    # each trunk: search, answer (2 turns) → one anchor (k = 1) per trunk, N = 1: 2 + 2 leaves per tree
    assert [t.num_leaves for t in trees] == [4, 4]
    for task in tasks:
        first = seen[f"t{tasks.index(task)}/m0"][0]
        call = first.choices[0].message.tool_calls[0]
        want = {"query": f"{task.meta['chain'][0]} {task.meta['path'][0]}"}
        assert (call.function.name, json.loads(call.function.arguments)) == ("search", want)
        assert first.choices[0].finish_reason == "tool_calls"
    # every stored turn is one the engine returned, ids and log-probs exactly; replays sampled nothing:
    # per tree 2 trunks × 2 turns + 2 branches × 1 fresh turn = 6 turns, 12 in all
    engine = {as_stored(r.token_ids, r.logprobs) for r in backend.results}
    nodes = [n for t in trees for n in t.nodes[1:]]
    assert len(backend.results) == len(nodes) == 12
    assert all(as_stored(n.tokens, n.behavior_logprobs) in engine for n in nodes)
    for t, task in zip(trees, tasks, strict=True):
        # the prompt and each observation: the ids the project's own loop makes (actors/protocols)
        assert t.prompt_tokens.tolist() == protocol.initial_context(env.system_prompt(), task.question)
        search = t.nodes[t.children[0][0]]
        obs = env.env.step_parsed(task, [], protocol.parse(tok.decode(search.tokens.tolist()))).observation
        assert search.obs_tokens.tolist() == protocol.observation_tokens(obs, search.tokens.tolist())
    # the log-probs the client got back are the stored ones
    responses = [r for rs in seen.values() for r in rs]
    returned = {
        as_stored(r.treeopsd["token_ids"], [x.logprob for x in r.choices[0].logprobs.content])
        for r in responses
    }
    assert all(as_stored(n.tokens, n.behavior_logprobs) in returned for n in nodes)


def chatty_harness(task, base_url, session):
    """Up to 3 turns, each answered with a user message: no tool needed, any model's turns continue."""
    c = client(base_url, task["api_key"])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task["question"]}]
    for _ in range(3):
        r = c.chat.completions.create(model="m", messages=msgs)
        if r.choices[0].finish_reason == "length":
            return 0.0
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    return 1.0


class Recorded(HFBackend):
    def sample(self, requests):
        out = super().sample(requests)
        self.results = [*getattr(self, "results", []), *out]
        return out


def test_hf_turns_are_stored_as_sampled_and_rescore_to_their_logprobs(kb):
    env, protocol, tok = kb
    model = build_tiny_model(tok, seed=0)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():  # the end of turn made likely, so that random turns end and episodes go on
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.convert_tokens_to_ids(tok.eos_token)] = 6.0
    model.lm_head = head
    backend = Recorded(model, tok, sampling=SamplingConfig(seed=0))
    tasks = env.tasks("train", n=2)
    sampler = external_sampler(backend, env, protocol, chatty_harness, shape=(2, 1), max_turn_tokens=24)
    try:
        trees = sampler.sample_trees(tasks, np.random.default_rng(1), ["h0", "h1"])
    finally:
        sampler.close()
    nodes = [n for t in trees for n in t.nodes[1:]]
    engine = {as_stored(r.token_ids, r.logprobs) for r in backend.results}
    assert len(nodes) == len(backend.results) and nodes
    assert all(as_stored(n.tokens, n.behavior_logprobs) in engine for n in nodes)
    assert any(len(n.obs_tokens) > 0 for n in nodes)  # multi-turn: observations between sampled turns
    worst = worst_rescore_gap(trees, backend.score)
    assert worst <= 1e-5, worst


def test_bad_requests_get_one_clear_error_and_cost_nothing_else(kb):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=1)
    got = {}

    def harness(task, base_url, session):
        msgs = [{"role": "user", "content": task["question"]}]
        post = lambda body, **kw: httpx.post(f"{base_url}/chat/completions", timeout=30, **body, **kw)  # noqa: E731
        sid = {"Authorization": f"Bearer {task['api_key']}"}
        got["temperature"] = post({"json": {"messages": msgs, "temperature": 0.5}, "headers": sid})
        got["stream"] = post({"json": {"messages": msgs, "stream": "yes"}, "headers": sid})
        got["seed"] = post({"json": {"messages": msgs, "seed": 3}, "headers": sid})
        got["json"] = post({"content": b'{"messages": [', "headers": sid})
        got["no_session"] = post({"json": {"messages": msgs}})
        got["unknown"] = post({"json": {"messages": msgs}, "headers": {**sid, "X-Session-Id": "nobody"}})
        r = client(base_url, task["api_key"]).chat.completions.create(
            model="m", messages=msgs, temperature=1.0
        )
        return 1.0 if r.choices[0].message.tool_calls else 0.0

    sampler = external_sampler(ToolScript(tok, tasks), env, protocol, harness, shape=(1, 0))
    try:
        [tree] = sampler.sample_trees(tasks, np.random.default_rng(0), ["e0"])
    finally:
        sampler.close()
    status = {k: r.status_code for k, r in got.items()}
    assert status == {
        "temperature": 400,
        "stream": 400,
        "seed": 400,
        "json": 400,
        "no_session": 401,
        "unknown": 400,
    }
    err = {k: r.json()["error"] for k, r in got.items()}
    assert (
        err["temperature"]["param"] == "temperature"
        and "sampler.temperature" in err["temperature"]["message"]
    )
    assert err["stream"]["param"] == "stream" and err["seed"]["param"] == "seed"
    assert "not valid JSON" in err["json"]["message"] and err["json"]["type"] == "invalid_request_error"
    assert "api key" in err["no_session"]["message"] and "'nobody'" in err["unknown"]["message"]
    # the episode itself went on: its one turn (a search call) stored with the harness's reward
    assert tree.num_leaves == 1 and tree.nodes[1].reward == 1.0
    # refused by the session's round: temperature, stream, seed; before any session (the endpoint itself):
    # malformed JSON, no key, two sessions named
    metrics = sampler.get_metrics()  # what the driver gets
    assert metrics["external/bad_requests"] == 3 and metrics["external/rejected_requests"] == 3


def test_a_token_is_required_off_loopback_and_checked():
    with pytest.raises(PermissionError, match=r"env\.agent_token"):
        AgentEndpoint(host="0.0.0.0")
    ep = AgentEndpoint(token="s3cret")
    try:
        url = f"{ep.url}/models"
        assert httpx.get(url).status_code == 401
        wrong = httpx.get(url, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        with pytest.raises(
            openai.NotFoundError, match="no sampling round"
        ):  # authorized, but no session runs
            openai.OpenAI(
                base_url=ep.url, api_key="s3cret", default_headers={"X-Session-Id": "x"}
            ).chat.completions.create(model="m", messages=[])
    finally:
        ep.close()
