"""The light roles as Ray runs them — the replay store and the backup — each a build function and the host
class that holds it (runtime/remote.py). A Ray worker imports the module that defines its actor's class:
these two need no torch, so a restarted store or backup is up in seconds (runtime/sampler_role.py and
runtime/learner_roles.py hold the others).
"""

from __future__ import annotations

from typing import Any

from actors.backup_worker import BackupWorker
from configs.algo import AlgoConfig
from runtime.remote import RoleLog, host_class, start_actor
from storage.replay_store import ReplayStore
from storage.replay_store_actor import RemoteStore


def build_store(directory: str, **options: Any) -> ReplayStore:
    return ReplayStore(directory, **options)


def build_backup(store: RemoteStore, algo: AlgoConfig) -> BackupWorker:
    return BackupWorker(store, algo)


StoreActor = host_class("StoreActor", ReplayStore, build_store)
BackupActor = host_class("BackupActor", BackupWorker, build_backup)


def start_store_actor(
    directory: str, name: str | None = None, max_restarts: int = 0, run_dir: str | None = None, **options: Any
) -> Any:
    """Starts `ReplayStore(directory, **options)` as a Ray actor (0 CPUs: it mostly waits on disk; one call
    at a time, so the store sees no concurrent calls).

    With `max_restarts` Ray restarts a dead store in place: the constructor reopens the directory (torn files
    quarantined, leases and reservations, which live in memory, handed back) and every client keeps its
    handle; a call in flight at the death fails (runtime/supervision.py). With `run_dir` the store logs to
    RUN_DIR/logs/store-0.log (a restart appends)."""
    ray_options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1, "max_restarts": max_restarts}
    if name is not None:  # the samplers look it up by name (runtime/sampler_role.py)
        ray_options["name"] = name
    log = None if run_dir is None else RoleLog(run_dir, "store")
    return start_actor(StoreActor, log, ray_options, directory, **options)
