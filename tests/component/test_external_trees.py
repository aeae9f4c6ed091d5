"""Trees grown from a harness (issue 40): the example harness gives M·(1+N) leaves whose branches replay their
anchors byte for byte and pass `store verify`; a non-deterministic harness gets its branches refused and
counted; a harness that drops `<think>` from its history is refused (409); a harness that crashes, hangs,
returns no reward or a non-number costs its own episode only; a reward may come by POST /v1/reward."""

import random
import time

import httpx
import numpy as np
import pytest

import examples.search_agent as example
from storage.replay_store import ReplayStore
from storage.store_verify import verify_store
from tests.external_fixtures import ToolScript, external_sampler, kb_setup


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


def grow(kb, harness, n_tasks=2, shape=(2, 2), think=False, script=ToolScript, **limits):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=n_tasks)
    sampler = external_sampler(script(tok, tasks, think), env, protocol, harness, shape=shape, **limits)
    try:
        trees = sampler.sample_trees(tasks, np.random.default_rng(0), [f"x{i}" for i in range(n_tasks)])
    finally:
        sampler.close()
    return trees, sampler


def test_example_harness_grows_full_trees_that_pass_store_verify(kb, tmp_path, monkeypatch):
    replies: dict[str, list] = {}

    class Recording(example.OpenAI):  # the example's own client, keeping what each session got back
        def __init__(self, **kw):
            super().__init__(**kw)
            create, session = self.chat.completions.create, kw["default_headers"]["X-Session-Id"]

            def recorded(**args):
                r = create(**args)
                replies.setdefault(session, []).append(r)
                return r

            self.chat.completions.create = recorded

    monkeypatch.setattr(example, "OpenAI", Recording)
    trees, sampler = grow(kb, example.run_episode, shape=(2, 2))
    # every trunk searches then answers: T = 2, one anchor (k = 1) drawn N = 2 times → M·(1+N) = 2·3 leaves
    assert [t.num_leaves for t in trees] == [6, 6]
    assert (
        sampler.external.stats["external/branches"] == 8
        and "external/branches_refused" not in sampler.external.stats
    )
    for key, rs in replies.items():
        if "/b" not in key:
            continue
        k = sum(r.treeopsd["replayed"] for r in rs)
        assert k == 1 and len(rs) == 2  # the anchor's turn replayed, then one fresh turn
        trunks = [v for name, v in replies.items() if name.startswith(key.split("/")[0] + "/m")]
        same = [
            t
            for t in trunks
            if [r.choices[0].message for r in t[:k]] == [r.choices[0].message for r in rs[:k]]
        ]
        assert same and same[0][0].treeopsd["token_ids"] == rs[0].treeopsd["token_ids"]  # byte-identical
    for t in trees:  # each branch hangs under its anchor: its first k = 1 turn is the trunk's own node
        assert len(t.children[0]) == 2  # no first turn stored twice
        assert [len(t.children[c]) for c in t.children[0]] == [3, 3]  # the trunk's 2nd turn + 2 branches
    with ReplayStore(tmp_path / "store") as store:
        store.put_raw(trees)
    assert verify_store(tmp_path / "store").ok


def noisy_harness(task, base_url, session):
    """The example harness with a tool whose results change from run to run (a clock, a live web search)."""
    call = task["call_tool"]
    task = {**task, "call_tool": lambda name, args: f"{call(name, args)} (fetched {random.random():.6f})"}
    return example.run_episode(task, base_url, session)


def test_non_deterministic_harness_gets_its_branches_refused_and_counted(kb):
    trees, sampler = grow(kb, noisy_harness, shape=(2, 1))
    assert [t.num_leaves for t in trees] == [2, 2]  # the trunks only: no branch stored
    # 2 trees × 2 trunks × N = 1: 4 branches planned, each refused at its anchor's observation
    assert (
        sampler.external.stats["external/branches"] == 4
        and sampler.external.stats["external/branches_refused"] == 4
    )
    assert (
        sampler.external.stats["external/context_mismatch"] == 4
        and sampler.external.stats["external/episodes_stored"] == 4
    )


def think_dropping_harness(task, base_url, session):
    """Sends its history back without the `<think>` blocks (as some chat templates and harnesses do)."""
    c = example.OpenAI(base_url=base_url, api_key=task["api_key"])
    msgs = [
        {"role": "system", "content": task["system_prompt"]},
        {"role": "user", "content": task["question"]},
    ]
    r = c.chat.completions.create(model="m", messages=msgs, tools=task["tools"])
    msg = r.choices[0].message.model_dump(exclude_none=True)
    assert msg["content"].startswith("<think>")
    msgs += [
        {**msg, "content": ""},
        {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "x"},
    ]
    c.chat.completions.create(model="m", messages=msgs, tools=task["tools"])  # 409: openai.ConflictError
    return 1.0


def test_a_history_without_its_think_blocks_is_refused(kb):
    trees, sampler = grow(kb, think_dropping_harness, n_tasks=1, shape=(2, 1), think=True)
    assert trees == [] and sampler.dropped_trees == 1  # both trunks refused: nothing of the tree is stored
    assert (
        sampler.external.stats["external/context_mismatch"] == 2
        and sampler.external.stats["external/episodes_dropped"] == 2
    )


def failing_harness(task, base_url, session):
    """Per trunk: m0 raises, m1 hangs, m2 returns no reward, m3 posts one, m4 returns a non-number; each
    after one good turn."""
    c = example.OpenAI(base_url=base_url, api_key=task["api_key"])
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": task["question"]}])
    m = session.rsplit("/m", 1)[1]
    if m == "0":
        raise RuntimeError("the harness broke")
    if m == "1":
        time.sleep(3.0)
    if m == "3":
        httpx.post(
            f"{base_url}/reward",
            json={"reward": 0.75},
            headers={"Authorization": f"Bearer {task['api_key']}"},
        )
    return "high" if m == "4" else None


def test_failing_harnesses_cost_their_own_episode_only(kb):
    trees, sampler = grow(kb, failing_harness, n_tasks=1, shape=(5, 0), timeout_s=1.0, reward_timeout_s=0.3)
    [tree] = trees
    assert tree.num_leaves == 1 and tree.nodes[1].reward == 0.75  # m3, rewarded through POST /v1/reward
    s = sampler.external.stats
    assert (s["external/harness_errors"], s["external/harness_timeouts"], s["external/no_reward"]) == (
        1,
        1,
        1,
    )
    assert s["external/bad_rewards"] == 1 and s["external/episodes_dropped"] == 4


class BrokenEngine(ToolScript):
    def sample(self, requests):
        raise RuntimeError("engine down")


def test_an_engine_failure_fails_the_round(kb):
    """Not a harness's fault: the harness gets a 500, and the round fails as the own loop's would."""
    with pytest.raises(RuntimeError, match="engine down"):
        grow(kb, example.run_episode, n_tasks=1, shape=(2, 0), script=BrokenEngine)
