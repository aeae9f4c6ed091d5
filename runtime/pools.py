"""GPU pools on a Ray cluster: check that the configured pools exist, and see where each actor landed.

A pool is a Ray custom resource `pool_<name>` that a node declares when it starts
(`launch/cluster.sh worker --pool sample=1` runs `ray start ... --resources '{"pool_sample": 1}'`); a role
with `resources.<role>.pool = name` asks for a sliver of it (runtime/topology.role_options), so Ray only
places that role on nodes of the pool. A pool that no node provides would leave the role's actors pending
forever, so `check_pools(cfg)` rejects it before any actor starts:

    init_ray(cfg)
    check_pools(cfg)        # ConfigError naming the role, the pool and the pools the cluster does provide
    topo = start_topology(cfg, model_path)
    actor_nodes()           # {"LearnerActor": [node_id], "SamplerActor": [node_id, node_id], ...}
    gcs_restarts(actor_id)  # how often Ray restarted an actor (runtime/fault_tolerance.py counts them)

Both need a connected Ray (`ray.init`). They check the nodes alive now: on an autoscaling cluster, start
(or keep) one node of every pool before the run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import ray

from configs.schema import Config, ConfigError

log = logging.getLogger(__name__)
ROLES = ("sampler", "learner", "backup", "store")
POOL_PREFIX = "pool_"


def pool_resource(name: str) -> str:
    """The Ray custom resource that stands for pool `name`."""
    return f"{POOL_PREFIX}{name}"


def _alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def pool_nodes(nodes: Iterable[dict[str, Any]] | None = None) -> dict[str, list[str]]:
    """{pool name: [node id, ...]} for the alive nodes of the connected cluster."""
    out: dict[str, list[str]] = {}
    for node in _alive_nodes() if nodes is None else nodes:
        for key, amount in node.get("Resources", {}).items():
            if key.startswith(POOL_PREFIX) and amount > 0:
                out.setdefault(key[len(POOL_PREFIX) :], []).append(node["NodeID"])
    return out


def check_pools(cfg: Config) -> None:
    """Raises ConfigError when a role's pool is provided by no alive node, or no node of it fits the role.

    "Fits" means the node has at least the role's num_cpus and num_gpus in total (Ray would otherwise keep
    the actor pending forever); a role without a pool must fit on some node of the cluster.
    """
    totals = ray.cluster_resources()
    provided = {k[len(POOL_PREFIX) :] for k, v in totals.items() if k.startswith(POOL_PREFIX) and v > 0}
    nodes = _alive_nodes()
    for role in ROLES:
        r = getattr(cfg.resources, role)
        key = f"resources.{role}.pool"
        if r.pool is not None and r.pool not in provided:
            have = ", ".join(sorted(provided)) or "none"
            raise ConfigError(
                f"{key} = {r.pool!r} is invalid: no node of the Ray cluster provides pool {r.pool!r} "
                f"(custom resource {pool_resource(r.pool)!r}); pools provided: {have}. Start a node with "
                f"`launch/cluster.sh worker --pool {r.pool}=1 ...` or pick a provided pool"
            )
        candidates = [
            n for n in nodes if r.pool is None or n.get("Resources", {}).get(pool_resource(r.pool), 0) > 0
        ]
        fits = [
            n
            for n in candidates
            if n["Resources"].get("CPU", 0) >= r.num_cpus and n["Resources"].get("GPU", 0) >= r.num_gpus
        ]
        if not fits:
            where = f"no node of pool {r.pool!r}" if r.pool is not None else "no node of the Ray cluster"
            sizes = [(n["Resources"].get("CPU", 0), n["Resources"].get("GPU", 0)) for n in candidates]
            best = ", ".join(f"CPU={c:g} GPU={g:g}" for c, g in sizes)
            raise ConfigError(
                f"resources.{role} = num_cpus {r.num_cpus:g}, num_gpus {r.num_gpus:g} is invalid: {where} "
                f"has that many CPUs and GPUs (nodes: {best or 'none'})"
            )


def actor_nodes(alive_only: bool = True) -> dict[str, list[str]]:
    """{actor class name: [node id of each actor, ...]} through Ray's state API (`ray.util.state`, served by
    the dashboard that `ray[default]` brings)."""
    from ray.util.state import list_actors

    filters: list[tuple[str, str, str | bool | int | float]] | None = None
    if alive_only:
        filters = [("state", "=", "ALIVE")]
    actors = list_actors(
        address=ray.get_runtime_context().gcs_address, filters=filters, limit=10_000, timeout=30
    )
    rows = [(a.class_name, str(a.node_id)) for a in actors]
    out: dict[str, list[str]] = {}
    for class_name, node_id in rows:
        out.setdefault(class_name, []).append(node_id)
    return out


def gcs_restarts(actor_id: str) -> int | None:
    """How often Ray restarted the actor `actor_id` (hex), from Ray's public state API; None where it cannot
    say (no dashboard, an old Ray): the fault tolerance then counts only the restarts it saw."""
    try:
        from ray.util.state import get_actor

        actor = get_actor(actor_id, timeout=10)
        return None if actor is None else int(actor.num_restarts)
    except Exception:  # any state-API failure only costs the count of restarts never seen
        return None
