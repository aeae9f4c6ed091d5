"""The whole asynchronous topology on local Ray with the tiny model (CPU): 2 samplers, backup actor,
learner, ZeroMQ weights; then the fault tests — SIGKILL a sampler mid-run (restarted, nothing lost) and
SIGKILL the learner (resume continues with no batch trained twice and none skipped)."""

import os
import signal
from pathlib import Path

import pytest

from configs.schema import load_config
from runtime.decisions import RoleFailed
from runtime.driver import Driver, start_topology, stop_topology
from storage.metrics import MemorySink, TensorboardSink, read_scalars
from storage.replay_store import ReplayStore
from storage.store_verify import verify_store
from system.roles import HostRole, SamplerRole, StoreRole
from tests.waiting import wait_until

pytestmark = pytest.mark.ray

TAGS = [
    "sampler/tokens_per_s",
    "sampler/idle_ratio",
    "sampler/wait_for_weights_s",
    "sampler/version",
    "learner/idle_ratio",
    "learner/wait_for_batch_s",
    "learner/mismatch_kl",
    "learner/loss",
    "learner/mb0/mean_abs_s",
    "learner/mb1/overshoot_frac",
    "store/stale_trees",
    "store/trees_pending",
    "tree/leaves",
    "tree/depth",
    "reward/mean",
    "weights/version_lag",
    "backup/trees",
]


def small_cfg(run_dir, **extra):
    overrides = {
        "run.run_dir": str(run_dir),
        "learner.batch_trees": 2,
        "learner.minibatches": 2,
        "sampler.num_samplers": 2,
        "algo.M": 2,
        "algo.N": 1,
        "env.max_turns": 3,
        "env.max_turn_tokens": 16,
        "store.eta": 1,
        **extra,
    }
    return load_config(overrides=[f"{k}={v}" for k, v in overrides.items()])


def pids(topo):
    return topo.ask_samplers(HostRole.pid)


def trained_lags(store_dir: Path) -> list[list[int]]:
    """Per trained batch k, each tree's version lag: the learner's version when it trained batch k (k: one
    step, one version, from 0) minus the oldest version that sampled any of the tree's turns. Read from the
    store's consumed log and the stored trees, not from the learner's metrics."""
    with ReplayStore(store_dir, create=False, readonly=True) as store:
        return [
            [k - int(t.versions.min()) for t in store.get_trees(store.batch_tree_ids(k))]
            for k in range(store.watermark())
        ]


def test_async_topology_trains_and_survives_a_sampler_kill(ray_cluster, tmp_path, tiny_model_dir):
    ray = ray_cluster
    cfg = small_cfg(tmp_path)
    topo = start_topology(cfg, tiny_model_dir)
    sink = TensorboardSink(tmp_path / "tb")
    try:
        driver = Driver(cfg, topo, sink)
        first = driver.run(2)
        assert first["steps"] == 2
        victim, pid = next(iter(pids(topo).items()))
        os.kill(pid, signal.SIGKILL)  # mid-run: it may be inside sample_and_push
        summary = driver.run(4)
        assert summary["steps"] == 4  # training went on while the sampler was down

        def restarted() -> dict | None:  # Ray restarts it (max_restarts); wait until it answers again
            topo.sampler_results(timeout_s=5)  # RLlib's health probe of the unhealthy ones
            now = pids(topo)
            return now if victim in now and len(topo.healthy_samplers()) == 2 else None

        new_pids = wait_until(restarted, timeout_s=300, interval_s=1)  # a restart loads torch and the model
        assert new_pids.get(victim) not in (None, pid)  # the same actor, answering from a new process
        versions = list(topo.ask_samplers(SamplerRole.version, timeout_s=60).values())
        assert max(versions) >= 2  # samplers applied broadcast weights
        stats = ray.get(topo.store.call(StoreRole.stats))
        assert stats["trees"]["consumed"] == 8 and stats["quarantined"] == 0  # 4 batches of B = 2
    finally:
        stop_topology(topo)
        sink.close()
    result = verify_store(tmp_path / "store")
    assert result.ok, result.errors
    # Staleness bounded by admission (docs/design.md §4), per tree, with η = 1: a tree admitted at learner
    # version v is trained by v + η, and its turns may carry weights one version older than v (a sampler
    # applies a broadcast between turns), so every lag is ≤ η + 1 = 2.
    lags = trained_lags(tmp_path / "store")
    assert len(lags) == 4 and all(len(b) == 2 for b in lags)  # 4 batches of B = 2
    assert max(max(b) for b in lags) <= 2, lags
    tags = set(read_scalars(tmp_path / "tb"))
    assert not [t for t in TAGS if t not in tags], sorted(tags)


def test_learner_kill_then_resume_trains_every_batch_once(ray_cluster, tmp_path, tiny_model_dir):
    ray = ray_cluster
    # no restart in the run: --resume does it; one sampler (the learner is what is killed: the CPU of a
    # second sampler's two starts is the suite's clock)
    cfg = small_cfg(tmp_path, **{"run.max_learner_restarts": 0, "sampler.num_samplers": 1})
    topo = start_topology(cfg, tiny_model_dir)
    sink = MemorySink()
    try:
        driver = Driver(cfg, topo, sink)
        driver.run(3)
        os.kill(ray.get(topo.learner.host(HostRole.pid)), signal.SIGKILL)
        with pytest.raises(RoleFailed, match="the learner failed"):
            driver.run(6)
    finally:
        stop_topology(topo)
    before = [int(v) for _, v in sink.series["learner/batch_index"]]
    assert before == [0, 1, 2]
    topo = start_topology(cfg, tiny_model_dir, resume=True)
    resumed = MemorySink()
    try:
        driver = Driver(cfg, topo, resumed)
        assert driver.step == 3  # restored from the step-3 checkpoint
        driver.run(6)
    finally:
        stop_topology(topo)
    after = [int(v) for _, v in resumed.series["learner/batch_index"]]
    assert before + after == [0, 1, 2, 3, 4, 5]  # every batch once, none skipped, in order
    assert verify_store(tmp_path / "store").ok
