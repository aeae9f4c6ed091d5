"""Where the roles run on Ray: the local instance or the cluster (`init_ray`), and each role's resources
(`role_options`). runtime/roles.py:Roles starts, replaces and stops the actors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

import ray

from configs.schema import Config
from runtime.lean_imports import WORKER_SETUP_HOOK
from runtime.leftovers import descendants

log = logging.getLogger(__name__)

LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "VLLM_HOST_IP": "127.0.0.1",
}
# Ray starts its workers at nice 15 (its `worker_niceness`), below any other process on the machine: the roles
# are the workload, and at nice 15 the learner and samplers starved beside two busy nice-0 processes (a
# tokenizer, an agent harness, a test worker): a kill-and-resume run that takes 47 s alone took 627 s and
# failed on Ray's own timeouts, 103 s with the roles at 0. Set RAY_worker_niceness to choose otherwise.
WORKER_NICENESS_ENV = {"RAY_worker_niceness": "0"}
# Ray prestarts task workers for the first driver; every role is an actor, which gets a worker of its own, so
# those sat idle for the whole run (2 processes, ~2.3 CPU-s to start and ~1 CPU-s a minute between them).
# Set RAY_prestart_worker_first_driver=1 to have them back.
NO_IDLE_WORKERS_ENV = {"RAY_prestart_worker_first_driver": "0"}


def required_cpus(cfg: Config) -> float:
    r = cfg.resources
    return (
        cfg.sampler.num_samplers * r.sampler.num_cpus
        + cfg.learner.ranks * r.learner.num_cpus
        + r.backup.num_cpus
        + r.store.num_cpus
    )


def init_ray(cfg: Config | None = None) -> None:
    """Joins RAY_ADDRESS if set (a cluster started by launch/cluster.sh), else starts a local one of its own.

    A local instance advertises at least the CPUs the roles ask for: samplers and the learner mostly wait on
    each other, so on a 2-core laptop 2 samplers + learner still run (oversubscribed) instead of hanging.
    """
    if ray.is_initialized():
        return
    num_cpus = None if cfg is None else max(os.cpu_count() or 1, int(required_cpus(cfg) + 0.999))
    for key, value in {**LOOPBACK_ENV, **WORKER_NICENESS_ENV, **NO_IDLE_WORKERS_ENV}.items():
        os.environ.setdefault(key, value)  # read by the raylet this process starts
    env = {
        "env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **LOOPBACK_ENV},
        "worker_process_setup_hook": WORKER_SETUP_HOOK,  # imports each role's model loading needs, no more
    }
    # roles log to their own files; the driver prints warnings and above only
    quiet: dict[str, Any] = {"runtime_env": env, "log_to_driver": False, "logging_level": logging.WARNING}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **quiet)
    else:
        # "local": a new instance even when a `ray start` cluster runs on this machine (a bare ray.init()
        # would join it, and then refuse num_cpus): two runs, or two test lanes, never share one by accident
        _start_local(num_cpus=num_cpus, include_dashboard=False, **quiet)


# Ray gives a node a hard-coded 30 s to register with its GCS (ray/_private/node.py). On a loaded machine (the
# test suite: 2 cores, ~10 runnable processes) a `treeopsd train` missed it in 2 of the last 5 fresh-clone
# runs and died with Ray's traceback; the same start tried again at once finds warm caches. Only a local
# instance is tried again: every process it started is this process's child, so none is left behind. A
# cluster's join is not (its node is not ours to stop).
STARTUP_TIMEOUT = "timed out during startup"


def _start_local(**kwargs: Any) -> None:
    """ray.init(address="local"), again after Ray's start-up timeout, the first try's processes stopped."""
    before = descendants(os.getpid()).items()  # (pid, start time): a reused pid is not mistaken for ours
    try:
        ray.init(address="local", **kwargs)
    except Exception as e:  # Ray raises a bare Exception for it
        if STARTUP_TIMEOUT not in str(e):
            raise
        log.warning("Ray's local instance did not start in 30 s (%s); stopping it and starting again", e)
        ray.shutdown()
        for pid, _ in descendants(os.getpid()).items() - before:  # the half-started GCS, raylet, helpers
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        ray.init(address="local", **kwargs)
    _stop_log_monitor()


def _stop_log_monitor() -> None:
    """Stops the local instance's log monitor. It tails every worker's log file to stream them to the drivers
    (a scan of the log folder every 0.1 s), and ours take none (log_to_driver=False: each role writes its own
    log file), so it only cost CPU: 76 CPU-s over a fresh-clone `make test` of 2 cores (18 instances), 35 of
    them in the session's shared one. ray.init has no switch for it (`ray start --include-log-monitor` does);
    the node's own kill_log_monitor also drops it from the processes that ray.shutdown stops."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is not None:
        node.kill_log_monitor(check_alive=False)


def role_options(cfg: Config, role: str) -> dict[str, Any]:
    r = getattr(cfg.resources, role)
    opts: dict[str, Any] = {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus}
    if r.pool:  # a node started with --resources '{"pool_<name>": N}'
        opts["resources"] = {f"pool_{r.pool}": 0.01}
    return opts
