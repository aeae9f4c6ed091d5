"""The roles' processes run at the driver's priority: Ray's default nice 15 starved them beside any busy
nice-0 process (runtime/topology.py:WORKER_NICENESS_ENV); and they load transformers without scikit-learn
(runtime/lean_imports.py); and no idle worker sits beside them (runtime/topology.py:NO_IDLE_WORKERS_ENV), nor
Ray's log monitor."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.remote import run_remote

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def test_a_worker_of_the_local_instance_runs_at_the_driver_s_niceness(ray_cluster):
    # `nice` without a command prints the niceness it inherited: here, a Ray worker's (os.nice(0) adds 0)
    assert int(run_remote(subprocess.check_output, {"num_cpus": 0}, ["nice"])) == os.nice(0) == 0


def test_a_worker_of_the_local_instance_sees_no_scikit_learn(ray_cluster):
    assert importlib.metadata.version("scikit-learn")  # installed here (the retrieval extra)
    # transformers asks find_spec whether it is installed: in a worker, init_ray's worker_process_setup_hook
    # has hidden it (runtime/lean_imports.py)
    assert run_remote(importlib.util.find_spec, {"num_cpus": 0}, "sklearn") is None


IDLE_PROBE = """
import json, os, time
import ray
from configs.schema import load_config
from runtime.topology import init_ray
init_ray(load_config())
from ray._private.worker import global_worker
raylet = global_worker.node.all_processes["raylet"][0].process.pid

@ray.remote(num_cpus=1)
class Role:  # every role is an actor: it gets a worker process of its own
    def pid(self):
        return os.getpid()

actor = Role.remote()
role = ray.get(actor.pid.remote())
time.sleep(2)  # Ray prestarts its workers when the first driver registers: long since begun by now
from runtime.leftovers import descendants
kids = list(descendants(raylet))
titles = [open(f"/proc/{p}/cmdline").read().split(chr(0))[0] for p in kids]
started = [open(f"/proc/{p}/cmdline").read().replace(chr(0), " ") for p in descendants(os.getpid())]
print(json.dumps({"titles": titles, "role_is_child": role in kids, "started": started}))
"""


def test_a_local_instance_started_by_init_ray_keeps_no_idle_workers_and_no_log_monitor():
    """Ray titles a prestarted task worker `ray::IDLE` until a task takes it: with prestart on (Ray's default)
    2 of them sat under the raylet beside the roles for a whole run. init_ray's own default is what counts
    here: the probe runs without the test session's RAY_prestart_worker_first_driver (tests/conftest.py).
    Nor is the log monitor left running (runtime/topology.py:_stop_log_monitor): the roles log to files."""
    unset = ("RAY_ADDRESS", "RAY_prestart_worker_first_driver")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    run = [sys.executable, "-c", IDLE_PROBE]
    out = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    probe = json.loads(out.stdout.splitlines()[-1])
    assert probe["role_is_child"], probe  # the raylet's processes were found: the role's worker is one
    assert not [t for t in probe["titles"] if t.startswith("ray::IDLE")], probe["titles"]
    started = probe["started"]  # every process the driver's ray.init started (its workers among them)
    assert any("gcs_server" in c for c in started) and not [c for c in started if "log_monitor" in c], started
