"""Ray shell around BackupWorker: credits raw trees as they land in the store actor."""

from __future__ import annotations

import time
from typing import Any

from actors.backup_worker import BackupWorker
from configs.schema import parse_config
from storage.replay_store_actor import RemoteStore


class BackupActor:
    def __init__(self, cfg: dict, store: Any) -> None:
        self.worker = BackupWorker(RemoteStore(store), parse_config(cfg).algo)

    def run_once(self, max_trees: int = 64, idle_sleep_s: float = 0.2) -> int:
        n = self.worker.run_once(max_trees)
        if n == 0:
            time.sleep(idle_sleep_s)  # nothing landed: back off instead of spinning the store actor
        return n

    def get_metrics(self) -> dict[str, float]:
        return dict(self.worker.stats)
