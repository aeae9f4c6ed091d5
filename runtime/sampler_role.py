"""The sampler role as Ray runs it: the function that builds `TreeSampler` inside its actor — its store
client (runtime/store_client.py: a store down while Ray restarts it ends the sampler's call, as
`StoreUnavailable`, not the sampler) and its ZeroMQ weight subscriber — and the host class that holds it
(runtime/remote.py), managed by RLlib's FaultTolerantActorManager (only runtime/roles.py starts or stops one).
"""

from __future__ import annotations

import uuid
from typing import Any

import ray
from ray.rllib.utils.actor_manager import FaultAwareApply

from actors.heap import freeze_long_lived
from actors.sampler_setup import sampler_parts
from actors.tree_sampler import TreeSampler
from actors.weight_subscriber import WeightSubscriber
from configs.schema import parse_config
from runtime.remote import host_class
from runtime.store_client import StoreLink, store_unavailable


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
    store_client = StoreLink(ray.get_actor(store), on_lost=store_unavailable)
    sampler = TreeSampler(**parts, store=store_client, weights=sub)
    freeze_long_lived()  # engine, model, env and index out of every full collection, as in-process samplers
    return sampler


class SamplerHealth(FaultAwareApply):
    """What RLlib's FaultTolerantActorManager needs of a sampler actor: the health probe (`ping`) and `apply`.

    `apply` lets a raised exception reach the driver as the call's error and leaves the process alive;
    RLlib's own exits the process on any exception. The driver decides (runtime/decisions.py): a failure the
    configuration causes (`SamplerConfigFailure`) stops the run with its one line, any other replaces this
    sampler through `runtime/roles.py:Roles` within `sampler.max_restarts`."""

    def apply(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        return func(self, *args, **kwargs)


SamplerActor = host_class("SamplerActor", TreeSampler, build_sampler, SamplerHealth)
