"""Ray shell of the sampler role: `TreeSampler` built from the config, with the Ray store client and the
ZeroMQ weight subscriber passed in; `sample_and_commit` (the role's work) is TreeSampler's own.

Managed by RLlib's FaultTolerantActorManager (health probes, restarts, in-flight bookkeeping), so the class
mixes in FaultAwareApply. A restarted actor re-runs __init__: it gets a fresh RNG stream and tree-id prefix
(no id collides with the dead incarnation's) and asks the publisher for the latest weights.
"""

from __future__ import annotations

import os
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


class SamplerActor(TreeSampler, FaultAwareApply):
    def __init__(
        self, cfg: dict[str, Any], model_path: str, index: int, store: Any, endpoint: str | None, key=None
    ) -> None:
        # FaultAwareApply.apply() reads these when an applied call raises
        self.config = SimpleNamespace(restart_failed_env_runners=True, delay_between_env_runner_restarts_s=0)
        self.cfg: Config = parse_config(cfg)
        incarnation = int(uuid.uuid4().int % 1_000_000)
        timeout = self.cfg.weights.fetch_timeout_s  # a version whose chunks stall this long is given up
        self.sub = WeightSubscriber(endpoint, key, fetch_timeout_s=timeout) if endpoint else None
        parts = sampler_parts(self.cfg, model_path, index, incarnation)
        parts["prefix"] = f"s{index}-{uuid.uuid4().hex[:8]}"
        super().__init__(**parts, store=RemoteStore(store), weights=self.sub)

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
