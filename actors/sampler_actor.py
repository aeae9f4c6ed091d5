"""Ray shell around SamplerWorker (≤100 lines): admission → sample trees → commit them to the store.

Managed by RLlib's FaultTolerantActorManager (health probes, restarts, in-flight bookkeeping), so the class
mixes in FaultAwareApply. A restarted actor re-runs __init__: it gets a fresh RNG stream and tree-id prefix
(no id collides with the dead incarnation's) and asks the publisher for the latest weights.
"""

from __future__ import annotations

import os
import time
import uuid
from types import SimpleNamespace
from typing import Any

import ray
from ray.rllib.utils.actor_manager import FaultAwareApply

from actors.sampler_worker import SamplerWorker
from actors.weight_subscriber import WeightSubscriber
from configs.schema import Config, parse_config
from storage.tree_codec import encode_ipc


class SamplerActor(FaultAwareApply):
    def __init__(self, cfg: dict, model_path: str, index: int, store: Any, endpoint: str | None, key=None):
        # FaultAwareApply.apply() reads these when an applied call raises
        self.config = SimpleNamespace(restart_failed_env_runners=True, delay_between_env_runner_restarts_s=0)
        self.cfg: Config = parse_config(cfg)
        incarnation = int(uuid.uuid4().int % 1_000_000)
        self.worker = SamplerWorker(self.cfg, model_path, index, incarnation)
        self.worker.prefix = f"s{index}-{uuid.uuid4().hex[:8]}"
        self.store = store
        self.sub = WeightSubscriber(endpoint, key) if endpoint else None
        self.worker.weight_hook = self.poll_weights
        self.wait_for_weights_s = 0.0
        self.started = time.perf_counter()

    def poll_weights(self, timeout_ms: int = 0) -> None:
        got = self.sub.poll(timeout_ms) if self.sub is not None else None
        if got is not None:
            version, named = got
            self.worker.apply_weights(named, version)

    def pid(self) -> int:
        return os.getpid()

    def version(self) -> int:
        return self.worker.version

    def sample_and_push(self, n: int, min_version: int = 0, wait_s: float = 60.0) -> dict[str, float]:
        """Samples up to n admitted trees (after reaching `min_version`), commits them, returns metrics."""
        t0 = time.perf_counter()
        self.poll_weights()  # an idle sampler still picks up each broadcast on its next call
        while self.worker.version < min_version and time.perf_counter() - t0 < wait_s:
            self.poll_weights(timeout_ms=100)
        self.wait_for_weights_s += time.perf_counter() - t0
        granted = ray.get(self.store.admit.remote(n))
        if granted == 0:  # the learner is η versions behind: wait a little instead of spinning
            self.poll_weights(timeout_ms=100)
            return {"admitted": 0.0, "trees": 0.0, "metrics": self.get_metrics()}
        try:
            trees = self.worker.sample(granted)
            ray.get(self.store.put_raw.remote(encode_ipc(trees)))
        except Exception:
            ray.get(self.store.release.remote(granted))  # give the reservation back before failing
            raise
        unused = granted - len(trees)
        if unused:
            ray.get(self.store.release.remote(unused))  # trees dropped by on_verifier_error=drop_tree
        lags = [self.worker.version - min(t.versions) for t in trees]
        out = {"admitted": float(granted), "trees": float(len(trees)), "lag": float(max(lags, default=0))}
        return {**out, "metrics": self.get_metrics()}  # metrics ride along: no extra (blocking) call

    def get_metrics(self) -> dict[str, float]:
        stats = dict(self.worker.stats)
        stats["sampler/version"] = float(self.worker.version)
        stats["sampler/wait_for_weights_s"] = self.wait_for_weights_s
        elapsed = time.perf_counter() - self.started
        stats["sampler/idle_ratio"] = max(0.0, 1.0 - stats["sampler/busy_s"] / max(elapsed, 1e-9))
        if self.sub is not None:
            sub = self.sub.stats()
            stats["weights/rejected"] = float(sub.get("rejected", 0))
        return stats

    def stop(self) -> None:
        if self.sub is not None:
            self.sub.close()
        self.worker.close()
