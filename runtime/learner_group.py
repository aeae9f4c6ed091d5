"""The learner on Ray: one `LearnerActor` (learner.ranks = 1, as before), or R `LearnerRankActor`s in a
placement group, one bundle per rank (docs/design.md §12); the ranks take the bundles node by node
(runtime/placement.py), so a node's ranks and GPUs are contiguous whatever order Ray numbered them in.

    group = start_learner_group(cfg, data, model_path, store, resume, opts)   # runtime/roles.py
    refs = group.call("train_step", 0.05)          # every rank runs the step: it is a run of collectives
    done, out = group.poll(refs, timeout_s=0.05)   # rank 0's answer once all are done; raises
                                                   # LearnerRankError naming the rank that died or hung
    group.stop()                                   # every rank, then the placement group

The bundles ask for the role's CPUs and GPUs (and its `resources.learner.pool`, as one actor does), packed
onto as few nodes as fit them, so the group spans nodes only when one node is too small. Rank 0's node
address and a free port there make the rendezvous of torch.distributed; each rank joins with a timeout of
`learner.collective_timeout_s`, so a collective that a lost rank never joins fails there, and the driver then
names the rank that died (Ray reports it) or the ones that never finished (hung).
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from configs.schema import Config, ConfigError

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
    actors: list[Any]  # in rank order; actors[0] is the learner the driver and the samplers talk to
    timeout_s: float  # learner.collective_timeout_s
    placement: PlacementGroup | None = None
    release: Callable[[LearnerGroup, float], None] | None = None  # runtime/roles.py:stop_learner_group

    @property
    def rank0(self) -> Any:
        return self.actors[0]

    def call(self, method: str, *args: Any) -> list[Any]:
        return [getattr(a, method).remote(*args) for a in self.actors]

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
        others = "; ".join(f"rank {r}: {_brief(e)}" for r, e in sorted(errors.items()) if r != culprit)
        if died:
            return f"learner rank {culprit} died ({_brief(errors[died[0]])}); then {others or 'nothing else'}"
        if raised:
            return f"learner rank {culprit} failed: {_brief(errors[raised[0]])}"
        if pending:
            return (
                f"learner rank {pending[0]} hung: it did not finish the step while the other ranks' "
                f"collectives timed out (learner.collective_timeout_s = {self.timeout_s:g}); {others}"
            )
        return f"learner ranks failed in a collective: {others}"

    def stop_calls(self, timeout_s: float) -> None:
        """Asks every rank to stop and waits up to `timeout_s` (the actors themselves: `stop`)."""
        refs = self.call("stop")
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for rank, ref in enumerate(refs):
            if ref not in ready or _error(ref) is not None:
                log.warning("learner rank %d did not stop cleanly", rank)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops every rank (best effort for the dead or stuck ones), kills them, frees the bundles: through
        `release`, which runtime/roles.py (the only code that stops actors) gave the group at its start."""
        if self.release is None:
            raise RuntimeError("a learner group not started by runtime/roles.py has no way to stop")
        self.release(self, timeout_s)


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


def _brief(e: BaseException) -> str:
    """One short line for a rank's error: Ray's death notice cut to its exit type, gloo's source location
    dropped."""
    cause = getattr(e, "cause", None) or e
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(cause).split()))
    if isinstance(e, ray.exceptions.RayActorError):
        kind = re.search(r"Worker exit type: (\w+)", text)
        text = "its worker process exited" + (f", {kind.group(1)}" if kind else "")
    return f"{type(cause).__name__}: {text}"[:240]


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
    pg = placement_group([dict(bundle) for _ in range(ranks)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ConfigError(
            f"learner.ranks = {ranks} is invalid: Ray could not place {ranks} learner bundles of {bundle} "
            f"within {PLACEMENT_TIMEOUT_S:.0f} s (cluster: {ray.cluster_resources()})"
        ) from None
    return pg


def _rank_bundles(pg: PlacementGroup, gpus_per_rank: float) -> list[int]:
    """The bundle index of each rank: a node's ranks contiguous, nodes in order (runtime/placement.py)."""
    from ray.util.placement_group import placement_group_table

    from runtime.placement import rank_slots

    placed = placement_group_table(pg)["bundles_to_node_id"]  # {bundle index: node id}
    node_gpus = {n["NodeID"]: float(n["Resources"].get("GPU", 0.0)) for n in ray.nodes() if n.get("Alive")}
    bundle_nodes = [placed[b] for b in range(len(placed))]
    return [slot.bundle for slot in rank_slots(bundle_nodes, node_gpus, gpus_per_rank)]


# The group's actors are started and stopped by runtime/roles.py (`start_learner_group`,
# `stop_learner_group`): the only code that starts or stops actors. The placement (`_placement`,
# `_rank_bundles`) stays here.
