"""Whole nodes lost on a fake multi-node cluster (`ray.cluster_utils.Cluster` on this machine).

The node drill through the CLI (`treeopsd drill --nodes 3 --kill-node ...`, faults/nodes.py): the learner's
node dies mid-run with every process on it, a replacement joins, and the run reaches its steps with no batch
trained twice or skipped, `store verify` clean and no committed tree lost. And the learner's placement with
fake GPUs: ranks take the placement group's bundles node by node (runtime/placement.py), checked where the
rank actors really land."""

from __future__ import annotations

import json
import os

import pytest

from tests.cli_runs import run_small

pytestmark = [pytest.mark.ray, pytest.mark.slow]
STEPS = 10  # a tiny run races through its last steps: the kill at step 2 must land mid-run


def test_the_run_heals_after_losing_the_learners_node(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "node-drill"
    done = run_small(
        "drill",
        "--nodes",
        "3",
        "--kill-node",
        "learner@2",
        "--steps",
        str(STEPS),
        "--run-dir",
        str(run_dir),
        "--timeout-min",
        "8",
        model_dir=tiny_model_dir,
        timeout_s=900,
    )
    report = json.loads((run_dir / "drill.json").read_text())
    assert done.returncode == 0 and report["ok"], (report.get("node_checks"), done.stderr[-3000:])
    assert report["outcome"] == "healed"
    (kill,) = report["node_kills"]
    assert (kill["at"], kill["role"], kill["pool"], kill["survivors"]) == (2, "learner", "train", [])
    assert len(kill["pids"]) >= 3  # the raylet, its agents, the learner's worker (and the backup's)
    assert kill["committed_trees"] > 0 and report["committed_trees_lost"] == []
    audit = report["audit"]
    assert audit["steps_trained"] == STEPS and audit["store_batches"] == STEPS
    assert audit["batches_trained_twice"] == [] and audit["batches_skipped"] == []
    # one restart, or two when the first was placed on the dead node before Ray called it dead (~10 s)
    assert 1 <= audit["restarts"]["learner"] <= 2
    assert audit["store_verify"][0].startswith("ok: ")
    assert not any(p for p in kill["pids"] if os.path.exists(f"/proc/{p}/cmdline") and _is_ray(p))


def _is_ray(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ray" in f.read()
    except OSError:
        return False


@pytest.fixture
def gpu_cluster():
    """A head with nothing to schedule and two nodes of fake GPUs (3 and 1), this process connected; the
    session's local Ray (if up) is shut down first and brought back after."""
    import ray
    from ray.cluster_utils import Cluster

    from configs.schema import load_config
    from runtime.driver import init_ray

    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        small = cluster.add_node(num_cpus=2, num_gpus=1)
        big = cluster.add_node(num_cpus=4, num_gpus=3)
        ray.init(address=cluster.address)
        yield {"big": big.node_id, "small": small.node_id}
    finally:
        ray.shutdown()
        cluster.shutdown()
        if was_up:
            init_ray(load_config(overrides=["sampler.num_samplers=4"]))


def test_ranks_land_node_by_node_with_fake_gpus(gpu_cluster):
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from configs.schema import load_config
    from runtime.learner_group import _placement, _rank_bundles
    from runtime.remote import run_remote

    def where() -> tuple[str, list[int]]:
        return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]

    options = {"num_cpus": 0.5, "num_gpus": 1.0}
    pg = _placement(load_config(overrides=["learner.ranks=4"]), 4, options)
    try:
        bundles = _rank_bundles(pg, 1.0)
        strategies = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b) for b in bundles]
        task = {"num_cpus": 0.01, "num_gpus": 1}
        landed = [run_remote(where, {**task, "scheduling_strategy": s}) for s in strategies]
    finally:
        remove_placement_group(pg)
    nodes = [node for node, _ in landed]
    big, small = gpu_cluster["big"], gpu_cluster["small"]
    assert nodes == [big, big, big, small]  # the node with most GPUs first, each node's ranks together
    assert sorted(bundles) == [0, 1, 2, 3]
    big_gpus = [g for node, gpus in landed if node == big for g in gpus]
    assert sorted(big_gpus) == [0, 1, 2]  # three distinct GPUs of the big node, one per rank
