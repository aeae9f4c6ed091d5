"""The learner on Ray: one `LearnerActor` (learner.ranks = 1, as before), or R `LearnerRankActor`s in a
placement group, one bundle per rank (docs/design.md §12); the ranks take the bundles node by node
(runtime/placement.py), so a node's ranks and GPUs are contiguous whatever order Ray numbered them in.

    group = start_learner_group(cfg, data, model_path, store, resume, opts)   # runtime/roles.py
    refs = group.call(LearnerRole.train_step, 0.05)   # every rank runs the step: it is a run of collectives
    done, out = group.poll(refs, timeout_s=0.05)   # rank 0's answer once all are done; raises
                                                   # LearnerRankError naming the rank that died or hung
    pg, options, address = rank_placement(cfg, ranks, opts)   # where each rank's actor goes

The bundles ask for the role's CPUs and GPUs (and its `resources.learner.pool`, as one actor does), packed
onto as few nodes as fit them, so the group spans nodes only when one node is too small. Rank 0's node
address and a free port there make the rendezvous of torch.distributed; each rank joins with a timeout of
`learner.collective_timeout_s`, so a collective that a lost rank never joins fails there, and the driver then
names the rank that died (Ray reports it) or the ones that never finished (hung).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from configs.schema import Config, ConfigError
from runtime.remote import Handle
from runtime.store_client import one_line
from system.roles import LearnerRole

P = ParamSpec("P")
T = TypeVar("T")

log = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 120.0
DEATH_GRACE_S = 10.0  # how long a failure waits for Ray to report a dead rank before calling the rest hung


# what torch.distributed's errors say (DistBackendError/DistNetworkError/DistStoreError, gloo, NCCL)
COLLECTIVE_SIGNS = (
    "DistError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "gloo",
    "NCCL",
    "Timed out",
    "timed out",
    "Connection closed",
    "Connection reset",
)


class LearnerRankError(RuntimeError):
    """A rank of the sharded learner died, hung or failed; the message names it."""


@dataclass
class LearnerGroup:
    actors: list[
        Handle[LearnerRole]
    ]  # in rank order; actors[0] is the learner the driver and samplers talk to
    timeout_s: float  # learner.collective_timeout_s
    placement: PlacementGroup | None = None

    @property
    def rank0(self) -> Handle[LearnerRole]:
        return self.actors[0]

    def call(
        self, method: Callable[Concatenate[LearnerRole, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> list[ray.ObjectRef[T]]:
        return [a.call(method, *args, **kwargs) for a in self.actors]

    def poll(self, refs: list[Any], timeout_s: float) -> tuple[bool, Any]:
        """(False, None) while a rank is still busy; (True, rank 0's result) when all are done."""
        if len(refs) == 1:  # one learner: its own errors, as before the sharded learner
            ready, _ = ray.wait(refs, timeout=timeout_s)
            return (True, ray.get(refs[0])) if ready else (False, None)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if any(_error(r) is not None for r in ready):
            raise LearnerRankError(self._diagnose(refs))
        return (True, ray.get(refs[0])) if len(ready) == len(refs) else (False, None)

    def wait(self, refs: list[Any], timeout_s: float | None = None) -> Any:
        """Rank 0's result once every rank is done (LearnerRankError if one fails or `timeout_s` passes)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            done, out = self.poll(refs, 1.0)
            if done:
                return out
            if deadline is not None and time.monotonic() > deadline:
                busy = [r for r, ref in enumerate(refs) if not ray.wait([ref], timeout=0)[0]]
                raise LearnerRankError(f"learner rank(s) {busy} did not answer within {timeout_s:.0f} s")

    def _diagnose(self, refs: list[Any]) -> str:
        """The message of a failed step: a dead rank first, then one that raised, then the hung ones."""
        ray.wait(refs, num_returns=len(refs), timeout=min(DEATH_GRACE_S, self.timeout_s))
        errors = {r: e for r, ref in enumerate(refs) if (e := _error(ref)) is not None}
        pending = [r for r, ref in enumerate(refs) if not ray.wait([ref], timeout=0)[0]]
        died = [r for r, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)]
        raised = [r for r, e in errors.items() if r not in died and not _is_collective(e)]
        culprit = died[0] if died else raised[0] if raised else None
        others = "; ".join(f"rank {r}: {one_line(e, 240)}" for r, e in sorted(errors.items()) if r != culprit)
        if died:
            then = others or "nothing else"
            return f"learner rank {culprit} died ({one_line(errors[died[0]], 240)}); then {then}"
        if raised:
            return f"learner rank {culprit} failed: {one_line(errors[raised[0]], 240)}"
        if pending:
            return (
                f"learner rank {pending[0]} hung: it did not finish the step while the other ranks' "
                f"collectives timed out (learner.collective_timeout_s = {self.timeout_s:g}); {others}"
            )
        return f"learner ranks failed in a collective: {others}"

    def stop_calls(self, timeout_s: float) -> None:
        """Asks every rank to stop and waits up to `timeout_s` (runtime/roles.py then kills the actors)."""
        refs = self.call(LearnerRole.stop)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for rank, ref in enumerate(refs):
            if ref not in ready or _error(ref) is not None:
                log.warning("learner rank %d did not stop cleanly", rank)


def _error(ref: Any) -> BaseException | None:
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.GetTimeoutError:
        return None
    except ray.exceptions.RayError as e:
        return e
    return None


def _is_collective(e: BaseException) -> bool:
    """A failure of torch.distributed (a peer gone, a collective timed out), not the rank's own bug."""
    cause = getattr(e, "cause", None) or e
    text = f"{type(cause).__name__} {cause}"
    return any(s in text for s in COLLECTIVE_SIGNS)


# ---- start ----------------------------------------------------------------------------------------------
def _rendezvous() -> tuple[str, int]:
    """This node's address (as Ray knows it) and a port free on it, for rank 0's TCP store."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), int(port)


def _placement(cfg: Config, ranks: int, options: dict[str, Any]) -> PlacementGroup:
    bundle = {"CPU": max(float(options["num_cpus"]), 0.01), **options.get("resources", {})}
    if options["num_gpus"]:
        bundle["GPU"] = float(options["num_gpus"])
    pg: PlacementGroup = placement_group([dict(bundle) for _ in range(ranks)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ConfigError(
            f"learner.ranks = {ranks} is invalid: Ray could not place {ranks} learner bundles of {bundle} "
            f"within {PLACEMENT_TIMEOUT_S:.0f} s (cluster: {ray.cluster_resources()})"
        ) from None
    return pg


def rank_placement(
    cfg: Config, ranks: int, options: dict[str, Any]
) -> tuple[PlacementGroup, list[dict[str, Any]], tuple[str, int]]:
    """The ranks' placement group, each rank's actor options (its bundle: a node's ranks contiguous) and the
    rendezvous address on rank 0's node; runtime/roles.py starts the actors with them."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from runtime.remote import run_remote

    pg = _placement(cfg, ranks, options)
    bundles = _rank_bundles(pg, float(options["num_gpus"] or 0))
    strategies = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b) for b in bundles]
    address = run_remote(_rendezvous, {"num_cpus": 0, "scheduling_strategy": strategies[0]})
    opts = {**options, "num_cpus": max(float(options["num_cpus"]), 0.01)}
    return pg, [{**opts, "scheduling_strategy": s} for s in strategies], address


def _rank_bundles(pg: PlacementGroup, gpus_per_rank: float) -> list[int]:
    """The bundle index of each rank: a node's ranks contiguous, nodes in order (runtime/placement.py)."""
    from ray.util.placement_group import placement_group_table

    from runtime.placement import rank_slots

    placed = placement_group_table(pg)["bundles_to_node_id"]  # {bundle index: node id}
    node_gpus = {n["NodeID"]: float(n["Resources"].get("GPU", 0.0)) for n in ray.nodes() if n.get("Alive")}
    bundle_nodes = [placed[b] for b in range(len(placed))]
    return [slot.bundle for slot in rank_slots(bundle_nodes, node_gpus, gpus_per_rank)]
