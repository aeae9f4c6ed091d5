"""`treeopsd train` with the example harness (issue 40): the samplers grow their trees through the agent
endpoint on local Ray (tiny model), 3 steps, then `--resume` trains one more; the store verifies; the
endpoint's counters reach tensorboard and its requests stay out of the sampler's log (issue 47). A harness
that fails every episode stops the run with one line naming it (issue 47). An agent in a process of its own
(examples/remote_agent.py) trains, its side calls stored as linked trees (issue 47). The run's `external/*`
counters, summed over 2 samplers, reach the step line and summary.json exactly; a batch of B main trees
carries their side trees; an agent in its own process serves 2 samplers from the run's discovery file. An
agent with a long context (a sub-agent, a summary, a compaction) trains on (4, 2) trees branched after its
compaction, no branch refused, its stored log-probs re-scored, only side trees with signal trained (issue
57)."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys

import pytest

from actors.external.discovery import ENDPOINTS_FILE, read_endpoints
from actors.external.side import signal
from actors.policy.hf_backend import HFBackend
from runtime.driver import Driver, start_topology, stop_topology
from storage.metrics import MemorySink, read_scalars
from storage.replay_store import ReplayStore
from storage.store_verify import verify_store
from tests.cli_runs import ROOT, SMALL_RUN, run_small
from tests.external_fixtures import ending_model_dir, worst_rescore_gap
from tests.waiting import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow]
HARNESS = ("env.harness=examples.search_agent:run_episode", "env.protocol=qwen3", "sampler.num_samplers=1")


def test_train_with_the_example_harness_runs_and_resumes(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    args = ("--run-dir", str(run_dir), "--no-progress", *HARNESS)
    done = run_small("train", "--steps", "3", *args, model_dir=tiny_model_dir, timeout_s=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    scalars = read_scalars(run_dir / "tb")
    # every trained tree came through the endpoint: B = 2 trees of M = 2 episodes per step at least
    assert max(v for _, v in scalars["external/episodes_stored"]) >= 3 * 2 * 2
    # the endpoint's counters ride in the sampler's metrics: at least one request per stored episode
    assert max(v for _, v in scalars["external/requests"]) >= 3 * 2 * 2
    assert [v for _, v in scalars["external/failures_in_row"]][-1] == 0
    assert "HTTP Request" not in (run_dir / "logs" / "sampler-0.log").read_text()  # DEBUG, not INFO
    resumed = run_small("train", "--resume", "--steps", "4", *args, model_dir=tiny_model_dir, timeout_s=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_run"]) == (4, 1)
    assert verify_store(run_dir / "store").ok


def test_a_harness_failing_every_episode_stops_the_run_with_one_line(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "broken"
    broken = ("env.harness=tests.external_fixtures:broken_harness", "env.harness_max_failures=4")
    fast = ("sampler.max_restarts=0", "sampler.unhealthy_grace_s=5")  # today's ending comes sooner
    args = ("--run-dir", str(run_dir), "--no-progress", *HARNESS[1:], *broken, *fast)
    done = run_small("train", "--steps", "3", *args, model_dir=tiny_model_dir, timeout_s=600)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr[-3000:]
    want = "treeopsd train: env.harness = tests.external_fixtures:broken_harness: 4 episodes in a row failed"
    assert last.startswith(want) and "RuntimeError: the harness broke" in last


# Ports the run binds later, so picked outside the kernel's ephemeral range (32768-60999) and Ray's worker
# ports (10002-19999): an ephemeral port freed here was taken by another process of the loaded CI machine
# before the sampler bound it ("Address already in use [config key: env.agent_port]").
QUIET_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port free on loopback now, from QUIET_PORTS."""
    rng = random.Random()
    for _ in range(100):
        port = rng.choice(QUIET_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {QUIET_PORTS}")


def test_an_agent_in_its_own_process_trains_and_its_side_calls_are_stored_linked(tmp_path, tiny_model_dir):
    """examples/remote_agent.py, an unmodified openai client in a process of its own, takes the run's
    episodes over HTTP (env.harness=actors.external.remote:queued), with a summary side call per episode."""
    run_dir, port = tmp_path / "remote", free_port()
    url = f"http://127.0.0.1:{port}/v1"
    agent = subprocess.Popen([sys.executable, "examples/remote_agent.py", "--url", url], cwd=ROOT)
    queued = ("env.harness=actors.external.remote:queued", f"env.agent_port={port}", *HARNESS[1:])
    queued = (*queued, "env.side_calls=all")  # the summaries of random text are one-leaf side trees
    try:
        args = ("--run-dir", str(run_dir), "--no-progress", *queued)
        done = run_small("train", "--steps", "3", *args, model_dir=tiny_model_dir, timeout_s=900)
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    assert verify_store(run_dir / "store").ok
    with ReplayStore(run_dir / "store", create=False, readonly=True) as store:
        trees = store.get_trees(store.tree_ids())
    mains = {t.tree_id: t for t in trees if t.meta["source"] == "external"}
    sides = [t for t in trees if t.meta["source"] == "external-side"]
    # 3 steps of B = 2 trees (main and side trees alike); M = 2 trunks under every root, at most
    # M·(1+N) = 4 leaves; every call of every session recorded
    assert len(mains) + len(sides) >= 3 * 2 and mains
    assert all(len(t.children[0]) == 2 and t.num_leaves <= 4 for t in mains.values())
    calls = [c for t in mains.values() for c in json.loads(t.meta["calls"]).values()]
    assert all(c[0] == [0, None] and [1, None] in c for c in calls)  # a summary per episode: segment 1
    # the side calls: trees of their own, linked to their episode's tree and sessions
    assert sides and all(t.meta["episode_tree"] in mains and t.num_leaves <= 4 for t in sides)
    for t in sides:
        sessions = json.loads(mains[t.meta["episode_tree"]].meta["calls"])
        assert all(x["session"] in sessions and x["conversation"] >= 1 for x in json.loads(t.meta["links"]))


def external_cfg(run_dir, **extra):
    from test_train_e2e import small_cfg  # B = 2, M = 2, N = 1, store.eta = 1, 2 samplers

    return small_cfg(run_dir, **{"env.protocol": "qwen3", **extra})


def test_the_external_counters_over_two_samplers_reach_the_step_line_and_summary(
    ray_cluster, tmp_path, tiny_model_dir, capsys
):
    """tests/external_fixtures.py:counted_harness does, per tree (prompts_per_request = 1: one tree per
    sampling call): trunk m1 raises; trunk m0 asks 1 main turn and 1 judge (a side call), sends 1 request with
    a forged key and posts its reward twice. So with T episode trees stored over the whole run (both
    samplers, every call: the calls in flight finish before the summary), exactly: episodes 2T, stored T,
    dropped T (harness_errors T), side_calls T, side_trees T, requests 2T (m0's two chat calls),
    rejected_requests T, reward_posts 2T, double_rewards T, no_reward 0, and limit_ended = the stored
    episodes whose main turn was cut (finish "truncated")."""
    counted = {"env.harness": "tests.external_fixtures:counted_harness", "env.side_calls": "all"}
    cfg = external_cfg(tmp_path, **counted)  # all: m0's judge is a side tree of one leaf
    topo = start_topology(cfg, tiny_model_dir)
    try:
        driver = Driver(cfg, topo, MemorySink())
        summary = driver.finish(driver.run(2))
    finally:
        stop_topology(topo)
    assert json.loads((tmp_path / "summary.json").read_text())["external"] == summary["external"]
    with ReplayStore(tmp_path / "store", create=False, readonly=True) as store:
        trees = {t.tree_id: t for t in store.get_trees(store.tree_ids())}
        batches = [store.batch_tree_ids(k) for k in range(2)]
    mains = [t for t in trees.values() if t.meta["source"] == "external"]
    T = len(mains)
    cut = sum(v == "truncated" for t in mains for v in json.loads(t.meta["finish"]).values())
    assert T >= 2 * 2 and all(t.num_leaves == 1 for t in mains)  # 2 steps of B = 2; m0's leaf only
    want = {"episodes": 2 * T, "episodes_stored": T, "episodes_dropped": T, "harness_errors": T}
    want |= {"side_calls": T, "side_trees": T, "requests": 2 * T, "rejected_requests": T}
    want |= {"reward_posts": 2 * T, "double_rewards": T, "no_reward": 0, "limit_ended": cut, "complete": True}
    assert {k: summary["external"][k] for k in want} == want
    assert summary["store"]["side_trees"] == {"total": T, "orphans": 0}
    # each batch: B = 2 main trees, each with its side tree (side trees take no slot, ride along)
    for ids in batches:
        sides = [trees[i] for i in ids if trees[i].meta["source"] == "external-side"]
        assert len(ids) - len(sides) == 2 and sorted(t.meta["episode_tree"] for t in sides) == sorted(
            i for i in ids if trees[i].meta["source"] == "external"
        )
    # the step line (no progress bar): every snapshot is of whole calls, so episodes = 2·side calls = 2·drops
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    counts = [re.search(r", ext (\d+)ep (\d+)side (\d+)drop$", x) for x in lines]
    assert len(lines) == 2 and all(c and int(c[1]) == 2 * int(c[2]) == 2 * int(c[3]) for c in counts), lines
    for i in (0, 1):  # the harness's requests are logged at DEBUG (httpx's INFO line demoted), not INFO
        assert "HTTP Request" not in (tmp_path / "logs" / f"sampler-{i}.log").read_text()


def free_range(n: int) -> int:
    """A port P with P .. P + n - 1 free on loopback (now)."""
    for _ in range(50):
        port = free_port()
        socks = []
        try:
            for p in range(port, port + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} free ports in a row")


def test_an_agent_in_its_own_process_serves_two_samplers_from_the_discovery_file(
    ray_cluster, tmp_path, tiny_model_dir
):
    """env.agent_port = P with 2 samplers: sampler i binds P + i (refused before: one sampler only), both
    listed in RUN_DIR/agent_endpoints.json; examples/remote_agent.py --run-dir serves both."""
    port = free_range(2)
    queued = {"env.harness": "actors.external.remote:queued", "env.agent_port": port}
    cfg = external_cfg(tmp_path, **queued, **{"env.harness_timeout_s": 60})
    topo = start_topology(cfg, tiny_model_dir)
    agent = [sys.executable, "examples/remote_agent.py", "--run-dir", str(tmp_path), "--idle-exit-s", "60"]
    proc = subprocess.Popen(agent, cwd=ROOT)
    try:
        listed = wait_until(lambda: len(read_endpoints(tmp_path / ENDPOINTS_FILE)) == 2, timeout_s=300)
        endpoints = read_endpoints(tmp_path / ENDPOINTS_FILE)
        assert listed and endpoints == [
            {"sampler": 0, "base_url": f"http://127.0.0.1:{port}/v1"},
            {"sampler": 1, "base_url": f"http://127.0.0.1:{port + 1}/v1"},
        ]
        driver = Driver(cfg, topo, MemorySink())
        driver.run(2)
        assert driver.drain_samplers(300)  # both samplers' first calls (admitted at once) are committed
    finally:
        stop_topology(topo)
        proc.terminate()
        proc.wait(timeout=30)
    assert read_endpoints(tmp_path / ENDPOINTS_FILE) == []  # each sampler withdrew its entry on close
    with ReplayStore(tmp_path / "store", create=False, readonly=True) as store:
        trees = store.get_trees(store.tree_ids())
    mains = [t for t in trees if t.meta["source"] == "external"]
    # every episode was the agent's (the queued harness waits for it): trees of both samplers' endpoints
    assert {t.tree_id.split("-")[0] for t in mains} == {"s0", "s1"}
    assert verify_store(tmp_path / "store").ok


@pytest.fixture(scope="module")
def ending_model(tmp_path_factory):
    return ending_model_dir(tmp_path_factory.mktemp("ending-model"))


def test_a_compacting_agent_with_a_sub_agent_trains_on_4_2_trees(tmp_path, ending_model):
    """tests/external_fixtures.py:long_context_harness (a sub-agent whose reply feeds the main conversation,
    a summary, a compaction, a judge and a title) on a tiny model whose turns end, (M, N) = (4, 2), 3 steps:
    no branch refused; anchors after the compaction; the turns the first weights sampled re-score to their
    stored log-probs; each step trains B = 2 episode trees and only the side trees that carry signal."""
    run_dir = tmp_path / "long"
    harness = ("env.harness=tests.external_fixtures:long_context_harness", *HARNESS[1:])
    args = ("train", "--steps", "3", "--run-dir", str(run_dir), "--no-progress", *harness)
    cmd = [sys.executable, "-m", "launch.cli", *args, f"model.path={ending_model}", *SMALL_RUN]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [*cmd, "algo.M=4", "algo.N=2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    ext = summary["external"]
    assert summary["steps"] == 3 and ext["branches"] > 0 and ext.get("branches_refused", 0) == 0, ext
    assert ext["compactions"] > 0 and ext["side_trees_skipped"] > 0  # the titles: one leaf each
    with ReplayStore(run_dir / "store", create=False, readonly=True) as store:
        trees = {t.tree_id: t for t in store.get_trees(store.tree_ids())}
        batches = [store.batch_tree_ids(k) for k in range(3)]
    mains = [t for t in trees.values() if t.meta["source"] == "external"]
    anchors = [a for t in mains for a in json.loads(t.meta["anchors"]).values()]
    assert sum(a["context"] >= 1 for a in anchors) >= 3  # branched after a compaction, counted
    assert all(t.restarts for t in mains) and all(len(t.children[0]) == 4 for t in mains)
    backend = HFBackend(ending_model)  # the weights of version 0
    assert worst_rescore_gap(mains, backend.score, version=0) <= 3e-5
    scalars = read_scalars(run_dir / "tb")
    for ids, (_, trained) in zip(batches, scalars["learner/trees"], strict=True):
        sides = [trees[i] for i in ids if trees[i].meta["source"] == "external-side"]
        assert len(ids) - len(sides) == 2 and all(signal(t) for t in sides)  # B episode trees + signal
        assert trained == len(ids)
