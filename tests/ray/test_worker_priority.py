"""The roles' processes run at the driver's priority: Ray's default nice 15 starved them beside any busy
nice-0 process (runtime/topology.py:WORKER_NICENESS_ENV)."""

from __future__ import annotations

import os
import subprocess

import pytest

from runtime.remote import run_remote

pytestmark = pytest.mark.ray


def test_a_worker_of_the_local_instance_runs_at_the_driver_s_niceness(ray_cluster):
    # `nice` without a command prints the niceness it inherited: here, a Ray worker's (os.nice(0) adds 0)
    assert int(run_remote(subprocess.check_output, {"num_cpus": 0}, ["nice"])) == os.nice(0) == 0
