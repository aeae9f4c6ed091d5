"""Self-healing roles on Ray (docs/design.md, "Supervision"): the driver's `Supervisor` observes a failure —
turns the Ray error into a `Failure` (runtime/decisions.py) — and decides, by the pure `decide`; the driver
applies the decision (runtime/recovery.py) and only `runtime/roles.py:Roles` starts, replaces or stops an
actor. The supervisor writes no one's state but its own counts.

    sup = Supervisor(cfg)                            # the driver holds one (runtime.driver.Driver)
    failure = sup.learner_failure(error)             # Failure("learner", "store-lost", cause, ranks=1)
    decision = sup.decide(failure)                   # ReconcileLearner(cause): pure, from the budgets
    sup.count("backup", 0, cause)                    # a restart the driver applied: budget, metric, log line
    sup.metrics()                                    # supervision/restarts_<role>, for tensorboard

Who restarts what:
  * samplers: Ray restarts a dead one in place (`sampler.max_restarts`); a sampler whose call raised (its
    HTTP agent endpoint included) lives on, and the driver has Roles replace it, within `sampler.max_restarts`
    for its slot; a failure the configuration causes stops the run;
  * the store: Ray (`run.max_store_restarts`): the constructor reopens the directory (torn files quarantined,
    leases and admission reservations, which live in memory, handed back), every client keeps its handle;
    a call in flight at the death fails, and each caller's failure path handles it (runtime/store_client.py);
  * the backup and the retrieval service: Roles starts a new actor (`run.max_backup_restarts`; the service
    within `decisions.RETRIEVAL_RESTARTS`, and the samplers follow its new URL);
  * the learner: Roles (`run.max_learner_restarts`). A single learner whose step raised only because the store
    was lost under it is kept: its model is whole, so the store is rewound to the learner's own version and
    the step is tried again. Anything else stops the learner (every rank) and starts it again with resume —
    newest valid checkpoint, store rewound to its watermark — on the same weight port, so the samplers'
    subscribers follow; if the endpoint changes anyway, the samplers are replaced by ones that subscribe to
    the new endpoint.

Every restart is a log line naming the role and the cause, and a metric; a role past its budget ends the run
with `RoleFailed` (the message names the role, its limit key and its last error; `treeopsd train` adds the
resume command).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import ray

from actors.failures import SamplerFailure, from_ray_error
from configs.schema import Config
from runtime.decisions import Budgets, Decision, Failure, decide
from runtime.learner_group import LearnerRankError
from runtime.restart_policy import failure_kind
from runtime.store_client import one_line as brief

__all__ = ["Supervisor", "brief", "gcs_restarts", "kind_of", "sampler_restarts"]
log = logging.getLogger("treeopsd.supervision")
ENDPOINT_SIGNS = ("agent endpoint", "agent_port")  # actors/external/endpoint.py's own failures


def gcs_restarts(actor_id: str) -> int | None:
    """How often Ray restarted the actor `actor_id` (hex), from Ray's public state API; None where it cannot
    say (no dashboard, an old Ray): the driver then counts only the restarts it saw itself."""
    try:
        from ray.util.state import get_actor

        actor = get_actor(actor_id, timeout=10)
        return None if actor is None else int(actor.num_restarts)
    except Exception:  # any state-API failure only costs the count of restarts the driver never saw
        return None


def sampler_restarts(topo: Any) -> int:
    """Ray's count (GCS) over the samplers the run manages now, or the manager's when Ray does not say;
    the manager sees only the restarts of samplers it had marked unhealthy (one killed between two calls is
    not)."""
    ids = [r.get() for r in topo.manager.foreach_actor("actor_id", timeout_seconds=30) if r.ok]
    counts = [gcs_restarts(i) for i in ids]
    seen = topo.manager.total_num_restarts()
    return int(seen if None in counts else max(seen, sum(c for c in counts if c is not None)))


def kind_of(e: BaseException) -> str:
    """The `Failure.kind` of a Ray error: a task error (the actor's code raised) whose cause is a lost actor
    is "store-lost" (the store: the only actor the roles call); a RayActorError otherwise means the actor
    itself died."""
    if isinstance(e, LearnerRankError):
        return "died" if " died " in str(e) else "raised"
    task = isinstance(e, ray.exceptions.RayTaskError)
    cause = getattr(e, "cause", None)
    kind = failure_kind(task, isinstance(cause, ray.exceptions.RayActorError))
    return "store-lost" if kind == "store" else kind


def sampler_failure(error: BaseException, slot: int, cfg: Config) -> tuple[Failure, SamplerFailure]:
    """A failed sampler call as a `Failure` (and the sampler's own explanation, for the final message)."""
    explained, by_sampler = from_ray_error(error, cfg)
    text = str(explained)
    if by_sampler and explained.is_config:
        kind = "config"
    elif not isinstance(error, ray.exceptions.RayTaskError):  # its process is gone: Ray restarts it
        kind = "died"
    else:
        kind = "raised"
    role = "endpoint" if kind == "raised" and any(s in text for s in ENDPOINT_SIGNS) else "sampler"
    return Failure(role, kind, text, slot, key=explained.key, log_path=explained.log_path), explained


class Supervisor:
    """Restart budgets, counts and the batch events of one driver (runtime/restart_policy.py)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        r = cfg.run
        self.budgets = Budgets.from_limits(
            learner=r.max_learner_restarts,
            store=r.max_store_restarts,
            backup=r.max_backup_restarts,
            sampler=cfg.sampler.max_restarts,
        )
        self.restarts: Counter[str] = Counter()
        self.step_retries = 0  # learner steps tried again after the store was lost under them
        self.events: list[tuple[str, int]] = []  # restart_policy.batch_audit reads these
        self.last_store_error = ""

    # ---- observe --------------------------------------------------------------------------------------
    def learner_failure(self, error: BaseException) -> Failure:
        kind, cause = kind_of(error), brief(error)
        log.warning("learner step failed (%s): %s", kind, cause)
        if kind == "raised":  # its own exception: the whole remote traceback, for the bug report
            log.warning("%s", error)
        return Failure("learner", kind, cause, ranks=self.cfg.learner.ranks)

    def backup_failure(self, error: BaseException) -> Failure:
        return Failure("backup", kind_of(error), brief(error))

    def store_failure(self, error: BaseException) -> Failure:
        """A call that found the store lost: Ray restarts it in place (the wait says whether it came back)."""
        self.last_store_error = brief(error)
        return Failure("store", "died", self.last_store_error)

    def retrieval_failure(self, error: BaseException) -> Failure:
        return Failure("retrieval", "died", brief(error))

    # ---- decide ---------------------------------------------------------------------------------------
    def decide(self, failure: Failure) -> Decision:
        """runtime/decisions.py's `decide` over this run's budgets (pure: nothing is counted here)."""
        decision = decide(failure, self.budgets)
        log.info("%s -> %s", failure, decision)
        return decision

    # ---- counts ---------------------------------------------------------------------------------------
    def count(self, role: str, index: int, cause: str) -> int:
        """A restart the driver applies: counted against the budget (per slot for a sampler), logged."""
        n = self.budgets.record(role, index, cause)
        self._restarted(role, cause)
        return n

    def count_ray_restarts(self, role: str, cause: str, n: int = 1) -> None:
        """Restarts Ray did in place (the store): counted and logged; Ray holds their limit."""
        budget = self.budgets.budget(role)
        budget.causes.extend([cause] * n)
        self._restarted(role, cause, n)

    def _restarted(self, role: str, cause: str, n: int = 1) -> None:
        self.restarts[role] += n
        limit = self.budgets.limits.get(role, "?")
        log.warning("restarting the %s (%d of %s): %s", role, self.restarts[role], limit, cause)

    def metrics(self) -> dict[str, float]:
        roles = ("learner", "store", "backup", "sampler", "retrieval")  # sampler: replaced by Roles, not Ray
        out = {f"supervision/restarts_{role}": float(self.restarts[role]) for role in roles}
        out["supervision/learner_step_retries"] = float(self.step_retries)
        return out

    def summary(self) -> dict[str, Any]:
        return {"restarts": dict(self.restarts), "learner_step_retries": self.step_retries}

    def trained(self, out: dict[str, Any]) -> None:
        """A learner step's metrics arrived: batch `learner/batch_index` is trained."""
        self.events.append(("trained", int(out["learner/batch_index"])))
