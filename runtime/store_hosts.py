"""The light roles as Ray runs them — the replay store and the backup — each a build function and the host
class that holds it (runtime/remote.py). A Ray worker imports the module that defines its actor's class:
these two need no torch, so a restarted store or backup is up in seconds. Only `runtime/roles.py:Roles`
starts or stops their actors (runtime/sampler_role.py and runtime/learner_roles.py hold the other hosts).
"""

from __future__ import annotations

from typing import Any

from actors.backup_worker import BackupWorker
from configs.algo import AlgoConfig
from runtime.remote import host_class
from storage.replay_store import ReplayStore
from storage.replay_store_actor import RemoteStore


def build_store(directory: str, **options: Any) -> ReplayStore:
    return ReplayStore(directory, **options)


def build_backup(store: RemoteStore, algo: AlgoConfig) -> BackupWorker:
    return BackupWorker(store, algo)


StoreActor = host_class("StoreActor", ReplayStore, build_store)
BackupActor = host_class("BackupActor", BackupWorker, build_backup)
