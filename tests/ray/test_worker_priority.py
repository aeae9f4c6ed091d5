"""The roles' processes run at the driver's priority: Ray's default nice 15 starved them beside any busy
nice-0 process (runtime/topology.py:WORKER_NICENESS_ENV)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.ray


def test_an_actor_of_the_local_instance_runs_at_the_driver_s_niceness(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Probe:
        def niceness(self) -> int:
            return os.nice(0)  # adds 0: reads this process's niceness

    probe = Probe.remote()
    try:
        assert ray.get(probe.niceness.remote()) == os.nice(0) == 0
    finally:
        ray.kill(probe)
