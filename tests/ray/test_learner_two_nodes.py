"""The sharded learner across Ray nodes: 2 ranks on the two nodes of a local two-node cluster (the cluster of
tests/ray/test_two_node_pools.py: launch/cluster.sh, both nodes on 127.0.0.2) train the one-rank step.

Each rank asks for 2 CPUs; the head has 2 and the worker 3, so the placement group's PACK strategy cannot put
both bundles on one node and the group spans the two."""

import pytest
from learner_group_fixtures import batches, group_cfg, reference, start_group, store_with, train
from test_two_node_pools import two_nodes  # noqa: F401  (the module-scoped two-node cluster fixture)

from runtime.roles import stop_learner_group

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_two_ranks_on_two_nodes_train_a_step(two_nodes, tmp_path, tiny_model_dir):  # noqa: F811
    from runtime.pools import actor_nodes

    cfg = group_cfg(tmp_path, cpus=2, collective_timeout_s=120.0)
    ref = reference(tiny_model_dir, cfg)
    (trees,) = batches(ref.model, ref.tokenizer, 1)
    store = store_with(tmp_path / "store", trees)
    group = start_group(cfg, tiny_model_dir, store)
    try:
        where = actor_nodes()["LearnerRankActor"]
        out = train(group)
    finally:
        stop_learner_group(group)
    assert len(set(where)) == 2, where  # one rank per node
    want = ref.step(trees)
    assert out["learner/loss"] == pytest.approx(want["learner/loss"], abs=1e-5)
    assert out["learner/grad_norm"] == pytest.approx(want["learner/grad_norm"], rel=1e-5)
