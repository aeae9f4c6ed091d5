"""Ray shell around BackupWorker: credits raw trees as they land in the store actor."""

from __future__ import annotations

from typing import Any

from actors.backup_worker import BackupWorker
from configs.schema import parse_config
from storage.replay_store_actor import RemoteStore


class BackupActor:
    def __init__(self, cfg: dict, store: Any) -> None:
        self.worker = BackupWorker(RemoteStore(store), parse_config(cfg).algo)

    def run_once(self, max_trees: int = 64) -> int:
        return self.worker.run_once(max_trees)

    def get_metrics(self) -> dict[str, float]:
        return dict(self.worker.stats)
