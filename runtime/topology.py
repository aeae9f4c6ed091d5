"""Where the roles run on Ray: the local instance or the cluster (`init_ray`), and each role's resources
(`role_options`). runtime/roles.py:Roles starts, replaces and stops the actors.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from configs.schema import Config
from runtime.lean_imports import WORKER_SETUP_HOOK

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
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet)


def role_options(cfg: Config, role: str) -> dict[str, Any]:
    r = getattr(cfg.resources, role)
    opts: dict[str, Any] = {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus}
    if r.pool:  # a node started with --resources '{"pool_<name>": N}'
        opts["resources"] = {f"pool_{r.pool}": 0.01}
    return opts
