"""Ray shell of the sampler role: `TreeSampler` built from the config, with the Ray store client and the
ZeroMQ weight subscriber passed in; `sample_and_commit` (the role's work) is TreeSampler's own.

Managed by RLlib's FaultTolerantActorManager (health probes, restarts, in-flight bookkeeping), so the class
mixes in FaultAwareApply. A restarted actor re-runs __init__: it gets a fresh RNG stream and tree-id prefix
(no id collides with the dead incarnation's) and asks the publisher for the latest weights.

A store actor that is down while Ray restarts it ends the call, not the sampler: FaultAwareApply exits the
actor on any exception (RLlib's rule: the state may be corrupt), which would spend a sampler restart on each
store restart, though the only Ray calls a sampler makes are to the store and nothing of its own is broken.
"""

from __future__ import annotations

import os
import time
import uuid
from types import SimpleNamespace
from typing import Any

import ray
from ray.rllib.utils.actor_manager import FaultAwareApply

from actors.sampler_setup import sampler_parts
from actors.tree_sampler import TreeSampler
from actors.weight_subscriber import WeightSubscriber
from configs.schema import Config, parse_config
from storage.replay_store_actor import RemoteStore

STORE_DOWN_BACKOFF_S = 0.5  # before returning, so the driver's next call does not spin while Ray restarts it


class SamplerActor(TreeSampler, FaultAwareApply):
    def __init__(
        self, cfg: dict[str, Any], model_path: str, index: int, store: str, endpoint: str | None, key=None
    ) -> None:
        # The store arrives by name, not as a handle: Ray keeps an actor handle passed to a constructor in
        # the object store, which a restarted sampler (max_restarts > 0) cannot rely on (ray-project/ray
        # #53727, logged as an error at every start); a name is looked up again by each incarnation.
        # FaultAwareApply.apply() reads these when an applied call raises
        self.config = SimpleNamespace(restart_failed_env_runners=True, delay_between_env_runner_restarts_s=0)
        self.cfg: Config = parse_config(cfg)
        incarnation = int(uuid.uuid4().int % 1_000_000)
        timeout = self.cfg.weights.fetch_timeout_s  # a version whose chunks stall this long is given up
        self.sub = WeightSubscriber(endpoint, key, fetch_timeout_s=timeout) if endpoint else None
        parts = sampler_parts(self.cfg, model_path, index, incarnation)
        parts["prefix"] = f"s{index}-{uuid.uuid4().hex[:8]}"
        super().__init__(**parts, store=RemoteStore(ray.get_actor(store)), weights=self.sub)

    def sample_and_commit(self, n: int, min_version: int = 0, wait_s: float = 60.0) -> dict[str, Any]:
        """TreeSampler's; when the store actor is unavailable, the call returns nothing admitted and counts
        it (`sampler/store_unavailable`). Trees a failed put_raw may still have committed stay committed
        (the store's own log); the others were never visible; the reservation went back before the raise
        (TreeSampler) or with the store's restart (reservations live in its memory)."""
        try:
            return super().sample_and_commit(n, min_version, wait_s)
        except ray.exceptions.RayActorError:  # the store actor: the only actor a sampler calls
            self.stats["sampler/store_unavailable"] = self.stats.get("sampler/store_unavailable", 0.0) + 1
            time.sleep(STORE_DOWN_BACKOFF_S)
            return {"admitted": 0.0, "trees": 0.0, "store_unavailable": 1.0, "metrics": self.get_metrics()}

    def pid(self) -> int:
        return os.getpid()

    def actor_id(self) -> str:
        """This actor's id (hex), for Ray's public state API (launch/cmd_soak.py counts restarts by it)."""
        return str(ray.get_runtime_context().get_actor_id())

    def get_metrics(self) -> dict[str, float]:
        stats = super().get_metrics()
        if self.sub is not None:
            stats["weights/rejected"] = float(self.sub.stats().get("rejected", 0))
        return stats

    def stop(self) -> None:
        if self.sub is not None:
            self.sub.close()
        self.close()
