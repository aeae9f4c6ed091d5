"""Where the roles run and how they start and stop on Ray (runtime/driver.py's Driver schedules them,
runtime/supervision.py restarts them): the local instance or the cluster, each role's resources, the
topology's actors, adding and retiring samplers.

Each actor holds one role object (runtime/remote.py: `ray.remote` is applied there and nowhere else):
`ReplayStore`, `TreeSampler`, `BackupWorker`, `Learner` (runtime/roles.py, sampler_role.py,
learner_roles.py); each role gets a `RemoteStore` client, so the step sequence they run is the one
`runtime/local.py` runs in one process.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.rllib.utils.actor_manager import FaultTolerantActorManager

from configs.schema import Config, to_dict
from runtime.learner_group import LearnerGroup, start_learner_group
from runtime.pools import check_pools
from runtime.remote import RoleLog, start_actor
from runtime.retrieval_actor import start_retrieval_service, stop_retrieval_service
from runtime.roles import BackupActor, start_store_actor
from runtime.sampler_role import SamplerActor
from storage.replay_store_actor import RemoteStore

log = logging.getLogger(__name__)

LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "VLLM_HOST_IP": "127.0.0.1",
}


def required_cpus(cfg: Config) -> float:
    r = cfg.resources
    return (
        cfg.sampler.num_samplers * r.sampler.num_cpus
        + cfg.learner.ranks * r.learner.num_cpus
        + r.backup.num_cpus
        + r.store.num_cpus
    )


def init_ray(cfg: Config | None = None) -> None:
    """Joins RAY_ADDRESS if set (a cluster started by launch/cluster.sh), else starts a local instance.

    A local instance advertises at least the CPUs the roles ask for: samplers and the learner mostly wait on
    each other, so on a 2-core laptop 2 samplers + learner still run (oversubscribed) instead of hanging.
    """
    if ray.is_initialized():
        return
    num_cpus = None if cfg is None else max(os.cpu_count() or 1, int(required_cpus(cfg) + 0.999))
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **LOOPBACK_ENV}}
    # roles log to their own files; the driver prints warnings and above only
    quiet = {"runtime_env": env, "log_to_driver": False, "logging_level": logging.WARNING}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **quiet)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, **quiet)


def role_options(cfg: Config, role: str) -> dict[str, Any]:
    r = getattr(cfg.resources, role)
    opts: dict[str, Any] = {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus}
    if r.pool:  # a node started with --resources '{"pool_<name>": N}'
        opts["resources"] = {f"pool_{r.pool}": 0.01}
    return opts


@dataclass
class Topology:
    store: Any
    learner: Any  # the learner actor (rank 0 of `learners` when learner.ranks > 1)
    backup: Any
    manager: FaultTolerantActorManager
    args: tuple
    next_index: int = 0
    refs: dict[str, Any] = field(default_factory=dict)
    retrieval: Any = None  # the shared retrieval service (runtime/retrieval_actor.py), if the run started one
    learners: LearnerGroup | None = None  # every learner rank (runtime/learner_group.py)


def start_topology(cfg: Config, model_path: str, resume: bool = False) -> Topology:
    check_pools(cfg)  # a pool no node provides fails here, before any actor starts
    data = to_dict(cfg)
    retrieval = start_retrieval_service(cfg, data)  # before the samplers: they get its URL through `data`
    store_name = f"treeopsd-store-{uuid.uuid4().hex[:12]}"  # samplers look it up by name (SamplerActor)
    store = start_store_actor(
        cfg.store_dir,
        name=store_name,
        eta=cfg.admission_eta,
        batch_size=cfg.learner.batch_trees,
        max_restarts=cfg.run.max_store_restarts,  # Ray restarts a dead store in place (runtime/supervision)
        run_dir=cfg.run.run_dir,  # RUN_DIR/logs/store-0.log
    )
    learners = start_learner_group(cfg, data, model_path, store, resume, role_options(cfg, "learner"))
    learner = learners.rank0
    endpoint, key = ray.get(learner.endpoint.remote())
    backup = start_backup(cfg, store)
    args = (data, model_path, store_name, endpoint, key)
    topo = Topology(store, learner, backup, FaultTolerantActorManager([], 1), args)
    topo.retrieval, topo.learners = retrieval, learners
    scale_samplers(topo, cfg, cfg.sampler.num_samplers)
    return topo


def scale_samplers(topo: Topology, cfg: Config, n: int, retiring: frozenset[int] = frozenset()) -> list[int]:
    """Adds sampler actors up to n (they subscribe and fetch the latest weights on start); returns the ids
    to retire when there are more than n — the driver stops calling those and removes them when idle."""
    ids = sorted(i for i in topo.manager.actor_ids() if i not in retiring)
    for _ in range(n - len(ids)):
        data, model_path, store_name, endpoint, key = topo.args
        opts = {**role_options(cfg, "sampler"), "max_restarts": cfg.sampler.max_restarts}
        log_to = RoleLog(cfg.run.run_dir, "sampler", topo.next_index)  # RUN_DIR/logs/sampler-<i>.log
        args = (data, model_path, topo.next_index, store_name, endpoint, key)
        actor = start_actor(SamplerActor, log_to, opts, *args)
        topo.next_index += 1
        topo.manager.add_actors([actor])
    return ids[n:] if n < len(ids) else []


def start_backup(cfg: Config, store: Any) -> Any:
    """A backup actor on a store; not restarted by Ray: the supervisor starts a new one (it is stateless)."""
    log_to = RoleLog(cfg.run.run_dir, "backup")  # RUN_DIR/logs/backup-0.log, appended
    options = {**role_options(cfg, "backup"), "max_restarts": 0}
    return start_actor(BackupActor, log_to, options, RemoteStore(store), cfg.algo)


def stop_topology(topo: Topology) -> None:
    """Stops every role (best effort for the dead ones), closes the store, and frees the actors."""
    topo.manager.foreach_actor("close", healthy_only=True, timeout_seconds=20)
    if topo.learners is not None:
        topo.learners.stop()  # every rank, killed, and the placement group freed
    try:
        ray.get(topo.store.close.remote(), timeout=30)
    except (ray.exceptions.RayError, TimeoutError) as e:
        log.warning("close did not stop cleanly: %s", e)
    for handle in (topo.backup, topo.learner, topo.store):
        ray.kill(handle, no_restart=True)
    topo.manager.clear()  # kills the samplers
    stop_retrieval_service(topo.retrieval)
