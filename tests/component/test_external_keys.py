"""Keys that open only their session, and requests that cannot stall the others (issue 57): a session's key
is refused on the global routes; the task queue and the model list take the bearer token only; an ended
episode's key expires; a session route needs the session's key also without a token (a header alone posts
no reward); a 15 MB prompt (and a 0.4 MB one, rendered and tokenized) does not delay another session's turns;
a chunked 200 MB body is refused with a 413 while it is read."""

import select
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from actors.external.endpoint import AgentEndpoint
from tests.external_fixtures import ToolScript, external_sampler, kb_setup


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def test_the_global_routes_take_the_bearer_token_only():
    ep = AgentEndpoint(token="tk")
    try:
        ep.opened("x0/m0")
        key = ep.session_key("x0/m0")
        for route in ("tasks/next", "models"):
            refused = httpx.get(f"{ep.url}/{route}", headers=bearer(key))
            assert refused.status_code == 401 and "own session" in refused.json()["error"]["message"]
            assert httpx.get(f"{ep.url}/{route}", headers=bearer("tk")).status_code == 200
        assert httpx.get(f"{ep.session_url('x0/m0')}/models", headers=bearer(key)).status_code == 200
    finally:
        ep.close()


def test_a_key_opens_its_session_while_the_episode_runs_and_a_header_alone_opens_nothing(kb):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=1)
    got, keys = {}, {}

    def harness(task, base_url, session):
        keys[session] = task["api_key"]
        c = openai.OpenAI(base_url=base_url, api_key=task["api_key"])
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": task["question"]}])
        if session.endswith("/m1"):  # m0's episode is over: its key has expired
            body = {"messages": [{"role": "user", "content": task["question"]}]}
            got["ended chat"] = httpx.post(
                f"{base_url}/chat/completions", json=body, headers=bearer(keys["x0/m0"])
            )
            got["ended reward"] = httpx.post(
                f"{base_url}/reward", json={"reward": 1}, headers=bearer(keys["x0/m0"])
            )
            header = {"X-Session-Id": session}  # no token set: the header names the session, opens nothing
            got["header only"] = httpx.post(f"{base_url}/reward", json={"reward": 1.0}, headers=header)
            got["key on tasks"] = httpx.get(f"{base_url}/tasks/next", headers=bearer(task["api_key"]))
        return float(r.choices[0].message.tool_calls is not None)

    sampler = external_sampler(ToolScript(tok, tasks), env, protocol, harness, shape=(2, 0))
    sampler.max_inflight = 1  # m0, then m1
    try:
        [tree] = sampler.sample_trees(tasks, np.random.default_rng(0), ["x0"])
    finally:
        sampler.close()
    status = {k: r.status_code for k, r in got.items()}
    assert status == {"ended chat": 410, "ended reward": 410, "header only": 401, "key on tasks": 401}
    assert "expired" in got["ended chat"].json()["error"]["message"]
    assert "api key" in got["header only"].json()["error"]["message"]
    assert tree.num_leaves == 2 and [tree.nodes[i].reward for i in tree.leaves] == [1.0, 1.0]
    metrics = sampler.get_metrics()
    assert metrics["external/rejected_requests"] == 4 and "external/reward_posts" not in metrics
    assert (
        metrics["external/errors/410_gone"] == 2 and metrics["external/errors/401_authentication_error"] == 2
    )


def test_a_huge_prompt_does_not_delay_another_sessions_turns(kb):
    """m0 sends a 15 MB first request (refused by the cheap bound before any rendering), m2 a 0.4 MB one
    (under that bound: rendered and tokenized in a worker thread, ~1 s here, then refused by its count),
    while m1 keeps asking for turns: none of m1's turns takes 1 s."""
    env, protocol, tok = kb
    tasks = env.tasks("train", n=1)
    big_done, latencies, refused, overlap = threading.Event(), [], {}, []

    def harness(task, base_url, session):
        c = openai.OpenAI(base_url=base_url, api_key=task["api_key"], max_retries=0, timeout=120)
        if session.endswith("/m1"):
            while not big_done.is_set() or len(latencies) < 3:
                t0 = time.perf_counter()
                ping = [{"role": "user", "content": f"{task['question']} ping {len(latencies)}"}]
                c.chat.completions.create(model="m", messages=ping)  # a new conversation each: no limit
                latencies.append(time.perf_counter() - t0)
                overlap.append(not big_done.is_set())
            return 1.0
        size = 15_000_000 if session.endswith("/m0") else 400_000
        time.sleep(0.3)  # m1 is under way
        t0 = time.perf_counter()
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x " * (size // 2)}])
        refused[session] = (err.value.body["type"], time.perf_counter() - t0)
        if len(refused) == 2:
            big_done.set()
        return 0.0

    sampler = external_sampler(
        ToolScript(tok, tasks), env, protocol, harness, shape=(3, 0), token_budget=150_000
    )
    try:
        [tree] = sampler.sample_trees(tasks, np.random.default_rng(0), ["x0"])
    finally:
        sampler.close()
    assert {k: v[0] for k, v in refused.items()} == {
        "x0/m0": "context_length_exceeded",
        "x0/m2": "context_length_exceeded",
    }
    assert sum(overlap) >= 2 and max(latencies) < 1.0, (latencies, refused)
    assert tree.num_leaves == 1 and sampler.external.stats["external/prompt_too_long"] == 2


def chunked_upload(url: str, key: str, total: int, chunk: int = 1 << 20) -> tuple[int, int]:
    """POSTs up to `total` bytes of a chunked body to `url` over a raw socket, stopping as soon as the server
    answers; (the status it answered, the bytes sent by then)."""
    where, _, path = url.removeprefix("http://").partition("/")
    host, _, port = where.rpartition(":")
    frame = f"{chunk:x}\r\n".encode() + b" " * chunk + b"\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /{path} HTTP/1.1\r\nHost: {where}\r\nAuthorization: Bearer {key}\r\n"
        sock.sendall(f"{head}Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        sock.setblocking(False)
        pending, sent = b"", 0
        while True:
            readable, writable, _ = select.select([sock], [sock] if sent < total else [], [], 30)
            if readable or not writable:  # the server answered (or went quiet: the reply below says)
                break
            pending = pending or frame
            try:
                n = sock.send(pending)
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):  # closed after its answer: read it below
                break
            pending, sent = pending[n:], sent + n
        sock.setblocking(True)
        reply = sock.recv(4096)
    return int(reply.split(b" ", 2)[1]), sent


def test_a_chunked_200_mb_body_is_refused_while_it_is_read():
    ep = AgentEndpoint()
    try:
        ep.opened("x0/m0")
        status, sent = chunked_upload(f"{ep.url}/chat/completions", ep.session_key("x0/m0"), 200 << 20)
    finally:
        ep.close()
    assert status == 413 and sent < 64 << 20  # answered once 16 MB were read, not after 200 MB were buffered
    assert ep.refusals.counts == {"413_request_too_large": 1}
