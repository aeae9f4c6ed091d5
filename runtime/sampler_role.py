"""The sampler role as Ray runs it: the function that builds `TreeSampler` inside its actor — its store
client and its ZeroMQ weight subscriber — and the host class that holds it (runtime/remote.py), managed by
RLlib's FaultTolerantActorManager (runtime/topology.py).
"""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import ray
from ray.rllib.utils.actor_manager import FaultAwareApply

from actors.failures import SamplerConfigFailure
from actors.heap import freeze_long_lived
from actors.sampler_setup import sampler_parts
from actors.tree_sampler import TreeSampler
from actors.weight_subscriber import WeightSubscriber
from configs.schema import parse_config
from runtime.remote import host_class
from storage.replay_store_actor import RemoteStore
from system.interfaces import StoreUnavailable

STORE_DOWN_BACKOFF_S = 0.5  # before returning, so the driver's next call does not spin while Ray restarts it


class SamplerStore(RemoteStore):
    """The sampler's store client: a store actor that is down (Ray restarting it) is `StoreUnavailable`,
    which ends the sampler's call, not the sampler (`TreeSampler.sample_and_commit`). RLlib's
    FaultAwareApply would exit the actor on any exception, spending a sampler restart on each store restart
    though nothing of the sampler's own is broken."""

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return super()._call(method, *args)
        except ray.exceptions.RayActorError as e:  # the store actor: the only actor a sampler calls
            time.sleep(STORE_DOWN_BACKOFF_S)
            raise StoreUnavailable(str(e).splitlines()[0] if str(e) else type(e).__name__) from e


def build_sampler(
    cfg: dict[str, Any], model_path: str, index: int, store: str, endpoint: str | None, key: Any = None
) -> TreeSampler:
    """The sampler role in its actor: `TreeSampler` from the config, the store looked up by name and the
    ZeroMQ weight subscriber. The store comes by name, not as a handle: Ray keeps an actor handle passed to
    a constructor in the object store, which a restarted sampler (max_restarts > 0) cannot rely on
    (ray-project/ray #53727); a name is looked up again by each incarnation. A restarted actor re-runs
    this: a fresh RNG stream and tree-id prefix, and the publisher asked for the latest weights."""
    config = parse_config(cfg)
    incarnation = int(uuid.uuid4().int % 1_000_000)
    timeout = config.weights.fetch_timeout_s  # a version whose chunks stall this long is given up
    sub = WeightSubscriber(endpoint, key, fetch_timeout_s=timeout) if endpoint else None
    parts = sampler_parts(config, model_path, index, incarnation)
    parts["prefix"] = f"s{index}-{uuid.uuid4().hex[:8]}"
    sampler = TreeSampler(**parts, store=SamplerStore(ray.get_actor(store)), weights=sub)
    freeze_long_lived()  # engine, model, env and index out of every full collection, as in-process samplers
    return sampler


class SamplerHealth(FaultAwareApply):
    """What RLlib's FaultTolerantActorManager needs of a sampler actor (health probes, `apply`)."""

    # FaultAwareApply.apply() reads these when an applied call raises
    config = SimpleNamespace(restart_failed_env_runners=True, delay_between_env_runner_restarts_s=0)

    def apply(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """RLlib's, except that a failure the configuration causes (a SamplerConfigFailure, e.g. a harness
        failing every episode) is raised to the driver, which stops the run on it, instead of exiting the
        actor into restarts that would fail the same way."""
        config_failure: list[SamplerConfigFailure] = []

        def guarded(actor: Any, *a: Any, **k: Any) -> Any:
            try:
                return func(actor, *a, **k)
            except SamplerConfigFailure as e:
                config_failure.append(e)
                return None

        out = super().apply(guarded, *args, **kwargs)
        if config_failure:
            raise config_failure[0]
        return out


SamplerActor = host_class("SamplerActor", TreeSampler, build_sampler, SamplerHealth)
