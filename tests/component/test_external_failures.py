"""Harness failures and rewards, counted (issue 47): a harness that fails every episode stops the run with
one line naming it (and one warning, not one per episode); a reward both returned and posted, or posted
twice, is refused and counted; an episode ended by a limit is stored with reward 0 and counted; every
`external/*` counter rides in the sampler's metrics (what `sample_and_commit` hands the driver)."""

import contextlib
import logging
import pickle
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest

from actors.external.remote import queued
from actors.failures import SamplerConfigFailure, from_ray_error
from storage.replay_store import ReplayStore
from tests.external_fixtures import ToolScript, external_sampler, kb_setup


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


def client(base_url, task):
    return openai.OpenAI(base_url=base_url, api_key=task["api_key"])


def ask(task, base_url, session, **kw):
    msgs = [{"role": "user", "content": task["question"]}]
    return client(base_url, task).chat.completions.create(model="m", messages=msgs, **kw)


def post_reward(base_url, task, value):
    headers = {"Authorization": f"Bearer {task['api_key']}"}
    return httpx.post(f"{base_url}/reward", json={"reward": value}, headers=headers, timeout=30)


def sampler_for(kb, harness, n_tasks=1, shape=(2, 0), store=None, **limits):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=n_tasks)
    sampler = external_sampler(
        ToolScript(tok, tasks), env, protocol, harness, shape=shape, store=store, tasks=tasks, **limits
    )
    return sampler, tasks


def grow(kb, harness, n_tasks=1, shape=(2, 0), **limits):
    sampler, tasks = sampler_for(kb, harness, n_tasks, shape, **limits)
    try:
        trees = sampler.sample_trees(tasks, np.random.default_rng(0), [f"x{i}" for i in range(n_tasks)])
    finally:
        sampler.close()
    return trees, sampler


# ---- 2: a harness that fails every episode --------------------------------------------------------------


def always_raises(task, base_url, session):
    ask(task, base_url, session)
    raise RuntimeError("the harness broke")


def test_a_harness_failing_every_episode_stops_the_run_with_one_line(kb, caplog):
    caplog.set_level(logging.INFO)
    sampler, tasks = sampler_for(kb, always_raises, n_tasks=4, shape=(2, 0), max_failures=5)
    sampler.max_inflight = 1  # one episode at a time: the 5th of the 8 stops the round
    try:
        with pytest.raises(SamplerConfigFailure) as err:
            sampler.sample_trees(tasks, np.random.default_rng(0), [f"x{i}" for i in range(4)])
    finally:
        sampler.close()
    line = str(err.value)
    assert err.value.key == "env.harness" and "\n" not in line
    # what the driver makes of it (runtime/driver.py): explained, a config failure, so the run stops on it
    failure, explained = from_ray_error(SimpleNamespace(cause=pickle.loads(pickle.dumps(err.value))), None)
    assert explained and failure.is_config and str(failure) == line
    assert line.startswith(f"env.harness = {__name__}:always_raises: 5 episodes in a row failed")
    assert "RuntimeError: the harness broke" in line
    # one warning (the first drop); the others counted, not logged one by one
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("actors.")]
    assert len(warned) == 1 and "dropped" in warned[0].getMessage()
    metrics = sampler.get_metrics()
    assert (metrics["external/harness_errors"], metrics["external/episodes_dropped"]) == (5, 5)
    assert (metrics["external/episodes"], metrics["external/failures_in_row"]) == (5, 5)


def fails_but_m2(task, base_url, session):
    ask(task, base_url, session)
    if not session.endswith("/m2"):
        raise RuntimeError("flaky")
    return 1.0


def test_a_success_resets_the_failure_streak(kb):
    sampler, tasks = sampler_for(kb, fails_but_m2, n_tasks=2, shape=(3, 0), max_failures=3)
    sampler.max_inflight = 1  # episodes one after another: m0 m1 m2 of x0, then of x1: F F S F F S
    try:
        trees = sampler.sample_trees(tasks, np.random.default_rng(0), ["x0", "x1"])
    finally:
        sampler.close()
    assert [t.num_leaves for t in trees] == [1, 1]
    metrics = sampler.get_metrics()
    assert metrics["external/harness_errors"] == 4 and metrics["external/failures_in_row"] == 0


# ---- 6: rewards given twice, episodes ended by a limit --------------------------------------------------


def test_a_reward_given_twice_is_refused_and_counted(kb):
    status = {}

    def harness(task, base_url, session):
        ask(task, base_url, session)
        if session.endswith("/m0"):  # posted and returned: which one is the reward?
            status["m0"] = post_reward(base_url, task, 0.5).status_code
            return 1.0
        status["m1"] = post_reward(base_url, task, 0.25).status_code
        second = post_reward(base_url, task, 0.75)
        status["m1 again"], status["why"] = second.status_code, second.json()["error"]["message"]
        return None

    [tree], sampler = grow(kb, harness)
    assert (status["m0"], status["m1"], status["m1 again"]) == (200, 200, 409)
    assert "already posted" in status["why"] and "0.25" in status["why"]
    assert tree.num_leaves == 1 and tree.nodes[1].reward == 0.25  # m1's first post stands; m0 dropped
    metrics = sampler.get_metrics()
    assert metrics["external/double_rewards"] == 2 and metrics["external/episodes_dropped"] == 1
    assert metrics["external/reward_posts"] == 3


def test_an_episode_ended_by_a_limit_is_stored_with_reward_0_and_counted(kb):
    got = {}

    def harness(task, base_url, session):
        c = client(base_url, task)
        msgs = [{"role": "user", "content": task["question"]}]
        r = c.chat.completions.create(model="m", messages=msgs)
        call = r.choices[0].message.tool_calls[0]
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "x"},
        ]
        try:
            c.chat.completions.create(model="m", messages=msgs)
        except openai.BadRequestError as exc:
            got[session] = exc.body["type"]
        return None  # no reward: the limit's 0 stands, no wait for a post

    [tree], sampler = grow(kb, harness, max_turns=1, reward_timeout_s=30.0)
    assert got == {"x0/m0": "max_turns", "x0/m1": "max_turns"}
    assert [tree.nodes[i].reward for i in tree.leaves] == [0.0, 0.0]
    metrics = sampler.get_metrics()
    assert metrics["external/limit_ended"] == 2 and metrics["external/episodes_stored"] == 2
    assert metrics["external/bad_requests"] == 2 and "external/no_reward" not in metrics


# ---- 8: the endpoint's counters in the sampler's metrics ------------------------------------------------


class BrokenEngine(ToolScript):
    def sample(self, requests):
        raise RuntimeError("engine down")


def test_counters_reach_the_metrics_even_when_the_round_fails(kb):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=1)

    def harness(task, base_url, session):
        httpx.post(f"{base_url}/chat/completions", json={"messages": []}, timeout=30)  # no session: rejected
        ask(task, base_url, session)  # the engine fails: 500
        return 1.0

    sampler = external_sampler(BrokenEngine(tok, tasks), env, protocol, harness, shape=(1, 0))
    try:
        with pytest.raises(RuntimeError, match="engine down"):
            sampler.sample_trees(tasks, np.random.default_rng(0), ["x0"])
    finally:
        sampler.close()
    metrics = sampler.get_metrics()
    assert (metrics["external/rejected_requests"], metrics["external/requests"]) == (1, 1)


def test_sample_and_commit_hands_the_counters_to_the_driver(kb, tmp_path):
    def harness(task, base_url, session):
        httpx.post(f"{base_url}/chat/completions", content=b"{", timeout=30)  # malformed: rejected
        with contextlib.suppress(openai.BadRequestError):  # refused (400): not this run's temperature
            ask(task, base_url, session, temperature=0.5)
        ask(task, base_url, session)
        return 1.0

    with ReplayStore(tmp_path / "store", eta=1, batch_size=1) as store:
        sampler, _ = sampler_for(kb, harness, n_tasks=1, shape=(1, 0), store=store)
        try:
            out = sampler.sample_and_commit(1)
        finally:
            sampler.close()
    m = out["metrics"]
    assert out["trees"] == 1 and m["sampler/trees"] == 1
    assert (m["external/requests"], m["external/bad_requests"], m["external/rejected_requests"]) == (2, 1, 1)
    assert (m["external/episodes"], m["external/episodes_stored"], m["external/failures_in_row"]) == (1, 1, 0)


def test_episodes_no_agent_takes_are_dropped_at_once_and_counted_apart(kb):
    """The queued harness of an agent in its own process, with no agent running: each episode is dropped
    once no request reached the endpoint for env.agent_wait_s (0.5 s here, not env.harness_timeout_s), as
    `external/no_agent`, without counting toward the failure streak that stops a run."""
    t0 = time.perf_counter()
    trees, sampler = grow(kb, queued, shape=(2, 0), agent_wait_s=0.5, max_failures=1)
    assert trees == [] and time.perf_counter() - t0 < 10
    metrics = sampler.get_metrics()
    assert (metrics["external/no_agent"], metrics["external/episodes_dropped"]) == (2, 2)
    assert metrics["external/failures_in_row"] == 0 and "external/harness_errors" not in metrics
