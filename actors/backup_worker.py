"""The backup role: raw trees in, credited trees out, as they land in the store (no Ray here; on Ray the
runtime/roles.py builds one inside its actor, with a `RemoteStore`).

    backup = BackupWorker(store, cfg.algo)
    n = backup.run_once(max_trees=64)     # store.lease_raw → credit_rollout_tree → store.put_credited

Each tree is credited once per lease; crediting is a pure function of the stored tree, so a tree handed out
again after a crash gets byte-identical credit (the store keeps the later copy).
"""

from __future__ import annotations

import time

from configs.algo import AlgoConfig
from system.credit import credit_rollout_tree
from system.interfaces import StoreClient


class BackupWorker:
    def __init__(self, store: StoreClient, algo: AlgoConfig) -> None:
        self.store, self.algo = store, algo
        self.stats: dict[str, float] = {"backup/trees": 0.0, "backup/busy_s": 0.0}

    def run_once(self, max_trees: int = 64, idle_sleep_s: float = 0.0) -> int:
        """Credits up to max_trees leased raw trees; with none waiting, sleeps `idle_sleep_s` (a remote
        backup backs off instead of spinning the store) and returns 0."""
        raw = self.store.lease_raw(max_trees)
        if not raw:
            time.sleep(idle_sleep_s)
            return 0
        t0 = time.perf_counter()
        credited = [credit_rollout_tree(tree, self.algo) for tree in raw]
        self.store.put_credited(credited)
        busy = time.perf_counter() - t0
        self.stats["backup/trees"] += len(credited)
        self.stats["backup/busy_s"] += busy
        self.stats["backup/s_per_tree"] = busy / max(len(raw), 1)
        return len(credited)

    def get_metrics(self) -> dict[str, float]:
        return dict(self.stats)
