"""Agents as they are (issue 47): a per-session api key names the session, so an unmodified client needs only
`base_url` and `api_key`; side calls (a summariser, a compaction) on a session are sampled and stored as
linked trees instead of a 409 that dropped the episode; the example agent runs as a process of its own,
fetching its tasks over HTTP, and its trees (main and side) pass `store verify`."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from actors.external.endpoint import AgentEndpoint
from actors.external.remote import queued
from storage.replay_store import ReplayStore
from storage.store_verify import verify_store
from tests.external_fixtures import ToolScript, call_text, external_sampler, kb_setup

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


class TwoSearches(ToolScript):
    """Searches twice (the chain's first two hops), then answers (right or wrong, by the seed)."""

    def text(self, req, rng):
        context = self.tok.decode(list(req.context))
        task = next(t for t in self.tasks if t.question in context)
        turn = context.count("<|im_start|>assistant") - 1
        if turn < 2:
            return call_text("search", query=f"{task.meta['chain'][0]} {task.meta['path'][turn]}"), False
        return call_text("answer", answer=task.answers[0] if rng.random() < 0.5 else "nobody"), True


def grow(kb, harness, names, shape=(2, 1), script=ToolScript, side_calls="all", token=None):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=len(names))
    sampler = external_sampler(
        script(tok, tasks), env, protocol, harness, shape=shape, token=token, side_calls=side_calls
    )
    try:
        trees = sampler.sample_trees(tasks, np.random.default_rng(0), names)
    finally:
        sampler.close()
    return trees, sampler


def test_a_per_session_key_names_the_session_and_cannot_be_forged(kb):
    seen, refused = [], {}

    def harness(task, base_url, session):
        c = openai.OpenAI(base_url=base_url, api_key=task["api_key"])  # base_url + api_key, nothing else
        msgs = [
            {"role": "system", "content": task["system_prompt"]},
            {"role": "user", "content": task["question"]},
        ]
        seen.append(
            c.chat.completions.create(model="m", messages=msgs, tools=task["tools"]).treeopsd["session"]
        )
        forged = task["api_key"].rsplit(".", 1)[0] + "." + "0" * 64
        body = {"messages": msgs, "tools": task["tools"]}
        refused[session] = httpx.post(
            f"{base_url}/chat/completions", json=body, headers=auth(forged), timeout=30
        )
        httpx.post(
            f"{base_url}/reward", json={"reward": 1.0}, headers=auth(task["api_key"])
        ).raise_for_status()
        return None

    [tree], sampler = grow(kb, harness, ["k0"], shape=(2, 0), token="s3cret")
    assert sorted(seen) == ["k0/m0", "k0/m1"] and tree.num_leaves == 2
    assert [tree.nodes[i].reward for i in tree.leaves] == [1.0, 1.0]  # posted with the key alone
    assert {r.status_code for r in refused.values()} == {401}
    assert sampler.get_metrics()["external/rejected_requests"] == 2  # the forged keys, before any session
    assert "names no session" in refused["k0/m0"].json()["error"]["message"]
    a, b = AgentEndpoint(token="s3cret"), AgentEndpoint(token="other")
    try:  # the key is an HMAC of the session under the token: another token, another key
        assert a.session_key("k0/m0") != b.session_key("k0/m0") and "s3cret" not in a.session_key("k0/m0")
        assert a.keyed_session("Bearer " + a.session_key("k0/m0")) == "k0/m0"
    finally:
        a.close(), b.close()


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def judged_harness(task, base_url, session):
    """Asks, then a judge (a fresh conversation on the same session), then answers."""
    c = openai.OpenAI(base_url=base_url, api_key=task["api_key"])
    msgs = [
        {"role": "system", "content": task["system_prompt"]},
        {"role": "user", "content": task["question"]},
    ]
    r = c.chat.completions.create(model="m", messages=msgs, tools=task["tools"])
    judge = [{"role": "system", "content": "Judge this."}, {"role": "user", "content": task["question"]}]
    j = c.chat.completions.create(model="m", messages=judge)
    assert (j.treeopsd["conversation"], j.treeopsd["parent_call"]) == (1, None)
    msg = r.choices[0].message.model_dump(exclude_none=True)
    msgs += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "x"}]
    r = c.chat.completions.create(model="m", messages=msgs, tools=task["tools"])
    assert (r.treeopsd["conversation"], r.treeopsd["call"], r.treeopsd["parent_call"]) == (0, 2, 0)
    return 1.0 if session.endswith("/m0") else 0.0


def test_a_side_call_is_sampled_and_stored_linked_not_refused(kb, tmp_path):
    trees, sampler = grow(kb, judged_harness, ["j0"], shape=(2, 0))
    stats = sampler.external.stats
    assert "external/context_mismatch" not in stats  # was a 409 that dropped every episode
    [main, side] = trees
    assert main.num_leaves == 2 and stats["external/episodes_stored"] == 2
    calls = json.loads(main.meta["calls"])
    assert calls == {k: [[0, None], [1, None], [0, 0]] for k in ("j0/m0", "j0/m1")}
    # both judges had the same prompt: one side tree, a leaf each, the episode's reward (1 and 0: a signal)
    assert (side.tree_id, side.prompt_id, side.meta["episode_tree"]) == ("j0/side0", main.prompt_id, "j0")
    links = json.loads(side.meta["links"])
    assert [(x["session"], x["conversation"], x["first_call"]) for x in links] == [
        ("j0/m0", 1, 1),
        ("j0/m1", 1, 1),
    ]
    assert [side.nodes[i].reward for i in side.leaves] == [1.0, 0.0]
    with ReplayStore(tmp_path / "store") as store:
        store.put_raw(trees)
    assert verify_store(tmp_path / "store").ok


def same_judged(task, base_url, session):
    judged_harness(task, base_url, session)
    return 1.0


@pytest.mark.parametrize(("side_calls", "stored"), [("train", 0), ("all", 1), ("exclude", 0)])
def test_side_trees_without_signal_are_counted_not_stored_unless_asked(kb, side_calls, stored):
    """Equal rewards: the judges' side tree has z = 0 at every leaf. `train` leaves it out (counted),
    `all` stores it, `exclude` stores no side tree at all."""
    trees, sampler = grow(kb, same_judged, ["e0"], shape=(2, 0), side_calls=side_calls)
    assert [t.tree_id for t in trees] == ["e0", *(["e0/side0"] * stored)] and trees[0].num_leaves == 2
    stats = sampler.external.stats
    assert (stats["external/side_calls"], stats["external/side_trees"]) == (2, stored)
    assert stats["external/side_trees_skipped"] == 1 - stored


def test_the_example_agent_in_its_own_process_compacts_and_branches_after_it(kb, tmp_path):
    """examples/remote_agent.py searches twice, asks for a summary (a side call: this scripted model writes
    a tool call, so the summary is empty and feeds nothing), then compacts its history to the question and
    goes on in a new conversation: search, search, answer. The episode's line is the 2 main calls and the
    3 compacted ones (5 calls, the compacted start a restart): N = 1 anchor per trunk anywhere on it."""
    env, protocol, tok = kb
    tasks = env.tasks("train", n=2)
    sampler = external_sampler(TwoSearches(tok, tasks), env, protocol, queued, shape=(2, 1), token="tk")
    agent = [
        sys.executable,
        "examples/remote_agent.py",
        "--url",
        sampler.external.endpoint.url,
        "--token",
        "tk",
    ]
    proc = subprocess.Popen([*agent, "--idle-exit-s", "5"], cwd=ROOT)
    try:
        trees = sampler.sample_trees(tasks, np.random.default_rng(0), ["r0", "r1"])
    finally:
        sampler.close()
        proc.wait(timeout=60)
    mains = [t for t in trees if t.meta["source"] == "external"]
    assert [t.num_leaves for t in mains] == [4, 4] and proc.returncode == 0
    after = 0
    for m in mains:
        calls = json.loads(m.meta["calls"])  # per trunk: 2 main calls, the summary, the 3 compacted ones
        assert all(
            c == [[0, None], [0, 0], [1, None], [2, None], [2, 3], [2, 4]]
            for k, c in calls.items()
            if "/m" in k
        )
        anchors = json.loads(m.meta["anchors"])  # per branch: its anchor's call, conversation, context
        assert len(anchors) == 2 and all(a["call"] in (1, 3, 4, 5) for a in anchors.values())
        where = {a["call"]: (a["conversation"], a["context"]) for a in anchors.values()}
        assert all(w == ((0, 0) if call == 1 else (2, 1)) for call, w in where.items())
        after += sum(a["context"] == 1 for a in anchors.values())
        for leaf in (int(x) for x in m.leaves):  # every episode's compacted turns sit under a restart
            runs = m.context_runs(leaf)
            assert len(runs) == 2 and len(runs[1]) == 4  # [restart, search, search, answer]
        assert m.num_leaves == 4 and m.restarts  # the trunks' restarts (branches from call 3 share one)
    # anchors at calls 3-5 are turns after the compaction: drawn from rng(0) here, at least one of the 4
    assert after >= 1
    with ReplayStore(tmp_path / "store") as store:
        store.put_raw(trees)
    assert verify_store(tmp_path / "store").ok
