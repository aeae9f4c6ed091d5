"""The roles' processes run at the driver's priority: Ray's default nice 15 starved them beside any busy
nice-0 process (runtime/topology.py:WORKER_NICENESS_ENV); and they load transformers without scikit-learn
(runtime/lean_imports.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess

import pytest

from runtime.remote import run_remote

pytestmark = pytest.mark.ray


def test_a_worker_of_the_local_instance_runs_at_the_driver_s_niceness(ray_cluster):
    # `nice` without a command prints the niceness it inherited: here, a Ray worker's (os.nice(0) adds 0)
    assert int(run_remote(subprocess.check_output, {"num_cpus": 0}, ["nice"])) == os.nice(0) == 0


def test_a_worker_of_the_local_instance_sees_no_scikit_learn(ray_cluster):
    assert importlib.metadata.version("scikit-learn")  # installed here (the retrieval extra)
    # transformers asks find_spec whether it is installed: in a worker, init_ray's worker_process_setup_hook
    # has hidden it (runtime/lean_imports.py)
    assert run_remote(importlib.util.find_spec, {"num_cpus": 0}, "sklearn") is None
