"""The backup role without Ray: raw trees in, credited trees out, as they land.

    backup = BackupWorker(store, cfg.algo)
    n = backup.run_once(max_trees=64)     # take_raw → credit (system.backup) → put_credited

Each tree is credited once per lease; crediting is a pure function of the stored tree, so a tree handed out
again after a crash gets byte-identical credit (the store keeps the later copy).
"""

from __future__ import annotations

import time
from typing import Any

from configs.schema import AlgoConfig
from system.backup import credit_rollout_tree


class BackupWorker:
    def __init__(self, store: Any, algo: AlgoConfig) -> None:
        self.store, self.algo = store, algo
        self.stats: dict[str, float] = {"backup/trees": 0.0, "backup/busy_s": 0.0}

    def run_once(self, max_trees: int = 64) -> int:
        raw = self.store.take_raw(max_trees)
        if not raw:
            return 0
        t0 = time.perf_counter()
        credited = [credit_rollout_tree(tree, self.algo) for tree in raw]
        self.store.put_credited(credited)
        busy = time.perf_counter() - t0
        self.stats["backup/trees"] += len(credited)
        self.stats["backup/busy_s"] += busy
        self.stats["backup/s_per_tree"] = busy / max(len(raw), 1)
        return len(credited)
