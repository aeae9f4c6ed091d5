"""The agent endpoint hardened (issue 47): a first prompt over `env.token_budget` is refused for its episode
only; a fixed `env.agent_port` is a port per sampler (a taken one refused at load, a range past 65535 and an
unprotected `env.agent_host` at config load); `logprobs` carry each token's raw bytes; a tool message must
answer a call; `parallel_tool_calls=false` is honoured; the harness's requests are logged at DEBUG, not
INFO."""

import json
import logging
import socket

import httpx
import numpy as np
import openai
import pytest

import examples.search_agent as example
from actors.external.discovery import check_ports
from actors.external.endpoint import AgentEndpoint
from configs.schema import ConfigError, load_config
from tests.external_fixtures import ToolScript, call_text, external_sampler, kb_setup


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


def grow(kb, harness, n_tasks=1, shape=(1, 0), script=ToolScript, **limits):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=n_tasks)
    backend = script(tok, tasks)
    sampler = external_sampler(backend, env, protocol, harness, shape=shape, **limits)
    try:
        trees = sampler.sample_trees(tasks, np.random.default_rng(0), [f"x{i}" for i in range(n_tasks)])
    finally:
        sampler.close()
    return trees, sampler, backend


def client(base_url, task):
    return openai.OpenAI(base_url=base_url, api_key=task["api_key"])


def start(task):
    return [
        {"role": "system", "content": task["system_prompt"]},
        {"role": "user", "content": task["question"]},
    ]


class Recording(ToolScript):
    """ToolScript keeping every request it was asked to sample."""

    def sample(self, requests):
        self.requests = [*getattr(self, "requests", []), *requests]
        return super().sample(requests)


# ---- 1: a first request over env.token_budget ---------------------------------------------------------


def test_a_prompt_over_the_token_budget_is_refused_for_its_episode_only(kb):
    got = {}

    def harness(task, base_url, session):
        msgs = start(task)
        if session.startswith("x0/"):  # task 0: a question far longer than the budget
            msgs[1]["content"] = task["question"] * 200
        try:
            r = client(base_url, task).chat.completions.create(model="m", messages=msgs, tools=task["tools"])
        except openai.BadRequestError as exc:
            got[session] = exc
            return 0.0
        return 1.0 if r.choices[0].message.tool_calls else 0.0

    trees, sampler, backend = grow(kb, harness, n_tasks=2, script=Recording)
    refused = got["x0/m0"]
    assert refused.status_code == 400 and refused.body["type"] == "context_length_exceeded"
    assert "env.token_budget (1200)" in refused.body["message"]
    # the engine was never asked for a turn without room: only task 1's one turn was sampled
    assert [r.max_new_tokens for r in backend.requests] == [64]
    assert [t.tree_id for t in trees] == ["x1"] and trees[0].nodes[1].reward == 1.0  # the round went on
    s = sampler.external.stats
    assert (s["external/prompt_too_long"], s["external/episodes_dropped"], sampler.dropped_trees) == (1, 1, 1)


# ---- 3, 4: config-load checks --------------------------------------------------------------------------

HARNESS = ["env.harness=examples.search_agent:run_episode", "env.protocol=qwen3"]


def test_a_fixed_agent_port_is_a_range_of_one_port_per_sampler():
    # sampler i binds env.agent_port + i: 8123 with 2 samplers is 8123..8124 (refused before issue 47 items)
    two = load_config(overrides=[*HARNESS, "env.agent_port=8123"])  # default: 2 samplers
    assert (two.env.agent_port, two.sampler.num_samplers) == (8123, 2)
    with pytest.raises(ConfigError) as err:  # 65535 + 1 is no port
        load_config(overrides=[*HARNESS, "env.agent_port=65535"])
    line = str(err.value)
    assert "\n" not in line and line.startswith("env.agent_port = 65535 is invalid")
    assert "P + 1 <= 65535 (sampler i binds P + i)" in line
    assert load_config(overrides=[*HARNESS, "env.agent_port=65535", "sampler.num_samplers=1"])
    assert load_config(overrides=[*HARNESS, "sampler.num_samplers=4"]).env.agent_port == 0  # a free port each


def test_a_taken_port_of_the_range_is_one_line_naming_env_agent_port():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        check_ports("127.0.0.1", port - 1, 1)  # the port below: free (or this test is unlucky)
        with pytest.raises(ValueError) as err:  # 2 samplers from port - 1: the second one's is taken
            check_ports("127.0.0.1", port - 1, 2)
    finally:
        taken.close()
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"env.agent_port = {port - 1}: port {port} on 127.0.0.1")
    assert line.endswith(f"the run's 2 sampler(s) need {port - 1}..{port} (sampler i binds {port - 1} + i)")


def test_an_agent_host_off_loopback_needs_a_token_at_config_load(monkeypatch):
    monkeypatch.delenv("TREEOPSD_AGENT_TOKEN", raising=False)
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[*HARNESS, "env.agent_host=0.0.0.0"])
    line = str(err.value)
    assert "\n" not in line and line.startswith("env.agent_host = '0.0.0.0' is invalid")
    assert "env.agent_token" in line and "$TREEOPSD_AGENT_TOKEN" in line
    given = load_config(overrides=[*HARNESS, "env.agent_host=0.0.0.0", "env.agent_token=t"])
    assert given.env.agent_token == "t"
    monkeypatch.setenv("TREEOPSD_AGENT_TOKEN", "from-env")
    assert load_config(overrides=[*HARNESS, "env.agent_host=0.0.0.0"]).env.agent_host == "0.0.0.0"
    monkeypatch.delenv("TREEOPSD_AGENT_TOKEN")
    assert load_config(overrides=["env.agent_host=0.0.0.0"]).env.harness is None  # no harness: no endpoint


# ---- 5: logprobs of tokens that split a character ------------------------------------------------------


class Japanese(ToolScript):
    def text(self, req, rng):
        return "日本", True


def test_logprob_bytes_are_each_tokens_raw_bytes(kb):
    got = []

    def harness(task, base_url, session):
        r = client(base_url, task).chat.completions.create(model="m", messages=start(task), logprobs=True)
        got.append(r)
        return 1.0

    grow(kb, harness, script=Japanese)
    [r] = got
    assert r.choices[0].message.content == "日本"
    entries = r.choices[0].logprobs.content
    # the tiny tokenizer has no merge for these characters: 3 + 3 one-byte tokens, then the end of turn
    raw = "日本".encode()  # e6 97 a5 e6 9c ac
    assert [e.bytes for e in entries[:-1]] == [[b] for b in raw]
    assert [e.token for e in entries[:-1]] == ["\\xe6", "\\x97", "\\xa5", "\\xe6", "\\x9c", "\\xac"]
    assert entries[-1].token == "<|im_end|>" and entries[-1].bytes == list(b"<|im_end|>")


# ---- 7: tool messages must answer a call; parallel_tool_calls=false -----------------------------------


def test_a_tool_message_answering_no_call_is_a_400_naming_it(kb):
    got = {}

    def harness(task, base_url, session):
        c = client(base_url, task)
        msgs = start(task)
        r = c.chat.completions.create(model="m", messages=msgs, tools=task["tools"])
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        bogus = [*msgs, {"role": "tool", "tool_call_id": "call_bogus", "content": "x"}]
        try:
            c.chat.completions.create(model="m", messages=bogus, tools=task["tools"])
        except openai.BadRequestError as exc:
            got["bogus"] = exc
        call = r.choices[0].message.tool_calls[0]
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": "x"})
        r = c.chat.completions.create(model="m", messages=msgs, tools=task["tools"])  # the right one: on
        return 1.0 if r.choices[0].message.tool_calls else 0.0

    [tree], sampler, _ = grow(kb, harness)
    err = got["bogus"].body
    assert err["param"] == "messages[3].tool_call_id" and "call_bogus" in err["message"]
    assert got["bogus"].status_code == 400
    assert tree.num_leaves == 1 and len(tree.nodes) == 3  # search, answer: the session went on
    assert sampler.external.stats["external/bad_requests"] == 1


class TwoCalls(ToolScript):
    """A turn carrying two tool calls (an engine that does not stop at the first `</tool_call>`)."""

    def text(self, req, rng):
        return call_text("search", query="a") + "\n" + call_text("search", query="b"), True


def test_parallel_tool_calls_false_gives_at_most_one_call_per_turn(kb):
    got = {}

    def harness(task, base_url, session):
        c = client(base_url, task)
        r = c.chat.completions.create(
            model="m", messages=start(task), tools=task["tools"], parallel_tool_calls=False
        )
        got[False] = r.choices[0].message
        return 1.0

    grow(kb, harness, script=TwoCalls)
    one = got[False]
    assert [json.loads(c.function.arguments) for c in one.tool_calls] == [{"query": "a"}]
    assert call_text("search", query="b") in one.content  # the second call stays text, as sampled


def test_parallel_tool_calls_default_keeps_every_call(kb):
    got = []

    def harness(task, base_url, session):
        r = client(base_url, task).chat.completions.create(
            model="m", messages=start(task), tools=task["tools"]
        )
        got.append(r.choices[0].message)
        return 1.0

    grow(kb, harness, script=TwoCalls)
    assert [json.loads(c.function.arguments) for c in got[0].tool_calls] == [{"query": "a"}, {"query": "b"}]


# ---- 8: the harness's requests are logged at DEBUG -----------------------------------------------------


def _log_http_at(caplog, level):
    """Root and httpx's loggers at `level`: importing vLLM sets httpx's own level to WARNING (vllm/logger.py),
    which would drop its INFO lines before any filter of ours saw them."""
    caplog.set_level(level)
    for name in ("httpx", "httpx2"):
        caplog.set_level(level, logger=name)


def _endpoint_request_records(caplog):
    """httpx's line per request (the openai client logs through its copy, httpx2)."""
    http = [r for r in caplog.records if r.name in ("httpx", "httpx2")]
    return [r for r in http if "/v1/chat/completions" in r.getMessage()]


def test_harness_requests_are_logged_at_debug_not_info(kb, caplog):
    _log_http_at(caplog, logging.INFO)
    grow(kb, example.run_episode)
    assert _endpoint_request_records(caplog) == []  # 2 requests (search, answer), none at INFO
    caplog.clear()
    _log_http_at(caplog, logging.DEBUG)
    grow(kb, example.run_episode)
    levels = [r.levelname for r in _endpoint_request_records(caplog)]
    assert levels == ["DEBUG", "DEBUG"]
    other = httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(200)))
    caplog.clear()
    _log_http_at(caplog, logging.INFO)
    other.get("http://example.invalid/v1/chat/completions")  # another server's request: left as it was
    assert [r.levelname for r in _endpoint_request_records(caplog)] == ["INFO"]


def test_the_endpoint_filter_goes_with_the_endpoint(caplog):
    ep = AgentEndpoint()
    url = ep.url
    ep.close()
    _log_http_at(caplog, logging.INFO)
    other = httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(200)))
    other.get(f"{url}/chat/completions")  # the port may be reused by anyone: no longer ours
    assert [r.levelname for r in _endpoint_request_records(caplog)] == ["INFO"]
