"""`treeopsd train` with the example harness (issue 40): the samplers grow their trees through the agent
endpoint on local Ray (tiny model), 3 steps, then `--resume` trains one more; the store verifies; the
endpoint's counters reach tensorboard and its requests stay out of the sampler's log (issue 47). A harness
that fails every episode stops the run with one line naming it (issue 47). An agent in a process of its own
(examples/remote_agent.py) trains, its side calls stored as linked trees (issue 47)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from storage.metrics import read_scalars
from storage.replay_store import ReplayStore
from storage.store_verify import verify_store
from tests.cli_runs import ROOT, run_small

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_agent_in_its_own_process_trains_and_its_side_calls_are_stored_linked(tmp_path, tiny_model_dir):
    """examples/remote_agent.py, an unmodified openai client in a process of its own, takes the run's
    episodes over HTTP (env.harness=actors.external.remote:queued), with a summary side call per episode."""
    run_dir, port = tmp_path / "remote", free_port()
    url = f"http://127.0.0.1:{port}/v1"
    agent = subprocess.Popen([sys.executable, "examples/remote_agent.py", "--url", url], cwd=ROOT)
    queued = ("env.harness=actors.external.remote:queued", f"env.agent_port={port}", *HARNESS[1:])
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
        assert all(x["session"] in sessions and x["segment"] >= 1 for x in json.loads(t.meta["links"]))
