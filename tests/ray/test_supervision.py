"""A learner past its restart budget stops the run with a message naming it (runtime/fault_tolerance.py), on
local Ray with the tiny model (CPU). The run that heals itself, every role SIGKILLed once and every batch
trained exactly once, is tests/ray/test_drill_cli.py (`treeopsd drill`)."""

from __future__ import annotations

import random

import pytest

from faults.processes import kill_role
from runtime.decisions import RoleFailed
from runtime.driver import Driver, start_topology, stop_topology
from storage.metrics import MemorySink
from tests.ray.test_train_e2e import small_cfg as train_e2e_cfg

pytestmark = [pytest.mark.ray, pytest.mark.slow]
B = 2


def small_cfg(run_dir, **extra):
    """test_train_e2e's small run with batches of B trees."""
    return train_e2e_cfg(run_dir, **{"learner.batch_trees": B, **extra})


def test_a_learner_past_its_budget_stops_the_run_naming_it(ray_cluster, tmp_path, tiny_model_dir):
    # one sampler: the learner's budget is what is tested (a second sampler's process cost ~14 CPU-s)
    cfg = small_cfg(tmp_path, **{"run.max_learner_restarts": 0, "sampler.num_samplers": 1})
    topo = start_topology(cfg, tiny_model_dir)
    try:
        driver = Driver(cfg, topo, MemorySink())
        driver.run(1)
        assert kill_role("learner", random.Random(0)) is not None
        with pytest.raises(RoleFailed) as e:
            driver.run(3)
    finally:
        stop_topology(topo)
    assert e.value.role == "learner"
    assert "the learner failed and its restarts are used up (0 of run.max_learner_restarts = 0)" in str(
        e.value
    )
    assert "its worker process exited" in e.value.last_error
