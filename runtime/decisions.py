"""What the driver does when a role fails, as one pure function: `decide(failure, budgets) -> Decision`.
No Ray and no writes here: runtime/supervision.py turns a Ray error into a `Failure`, the driver applies the
`Decision` (runtime/recovery.py) and only `runtime/roles.py:Roles` starts, replaces or stops an actor.

    budgets = Budgets.from_limits(learner=3, store=3, backup=10, sampler=3)
    decide(Failure("backup", "died", "its worker process exited"), budgets)
        # RestartRole(role="backup", index=0, attempt=1, backoff_s=0.0, cause=...)
    budgets.record("backup", 0, cause)       # the driver counts the restart it applied

| role (kind)                                | decision                                               |
|--------------------------------------------|--------------------------------------------------------|
| sampler died                               | LeaveToRay: Ray restarts it (`sampler.max_restarts`)   |
| sampler raised / its agent endpoint failed | RestartRole("sampler", slot): Roles replaces it        |
| ... past `sampler.max_restarts` (its slot) | DropSampler: the run goes on with the others           |
| sampler config failure                     | StopOnConfig: a restart would fail the same way        |
| store died (Ray restarts it in place)      | WaitForStore                                           |
| store unavailable (Ray's restarts used up) | Stop naming `run.max_store_restarts`                   |
| backup call failed: the store was lost     | WaitForStore                                           |
| learner, store lost, 1 rank                | ReconcileLearner (any other learner failure: restart)  |
| backup died / raised                       | RestartRole("backup") within `run.max_backup_restarts` |
| learner died / raised / sharded            | RestartLearner within `run.max_learner_restarts`       |
| retrieval service died                     | RestartRole("retrieval") within `RETRIEVAL_RESTARTS`   |
| any role past its budget                   | Stop: one line, the role, its limit key, last error    |
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.restart_policy import LIMIT_KEYS, RestartBudget, RoleFailed, backoff_s, learner_action

ROLES = ("sampler", "store", "backup", "learner", "retrieval", "endpoint")
KINDS = ("died", "raised", "store-lost", "config", "unavailable", "start-failed", "unreconciled")
RETRIEVAL_RESTARTS = 3  # the service is stateless (its index is on disk); no config key holds this yet


@dataclass(frozen=True)
class Failure:
    """One failure of one role, as the supervisor observed it.

    kind: "died" (its process is gone), "raised" (its own code raised), "store-lost" (its call failed because
    the store was lost under it), "config" (the configuration causes it: `key` names the key), "unavailable"
    (it does not answer and Ray will not bring it back), "start-failed" (a restart did not start),
    "unreconciled" (a kept learner could not be re-synced)."""

    role: str
    kind: str
    cause: str  # one line: the exception type and its message
    index: int = 0  # a sampler's slot (its log file's number), a learner's rank
    ranks: int = 1  # the learner's ranks (a sharded group is never kept)
    key: str | None = None  # the config key to blame (kind "config")
    log_path: str | None = None  # the role's log file, where the failure names one

    def __post_init__(self) -> None:
        if self.role not in ROLES or self.kind not in KINDS:
            raise ValueError(f"unknown failure: role {self.role!r}, kind {self.kind!r}")


@dataclass(frozen=True)
class LeaveToRay:
    """Ray restarts the actor in place (its `max_restarts`); the driver only counts the failure."""

    role: str
    index: int
    cause: str


@dataclass(frozen=True)
class WaitForStore:
    """Wait until the store answers again; a new pid is a restart: counted, told the learner's version."""

    cause: str


@dataclass(frozen=True)
class RestartRole:
    """Roles stops the actor (if it still lives) and starts a new one after `backoff_s`."""

    role: str
    index: int
    attempt: int  # 1, 2, ... within the role's budget
    backoff_s: float
    cause: str


@dataclass(frozen=True)
class DropSampler:
    """A sampler slot past its restarts: removed, the run goes on with the others."""

    index: int
    cause: str


@dataclass(frozen=True)
class ReconcileLearner:
    """Keep the live learner (its model is whole) and rewind the store to its version."""

    cause: str


@dataclass(frozen=True)
class RestartLearner:
    """Stop every rank, start the group again from its newest checkpoint after `backoff_s`."""

    attempt: int
    backoff_s: float
    cause: str


@dataclass(frozen=True)
class Stop:
    """The run ends: the role failed once more than its budget allows."""

    role: str
    used: int
    limit: int
    last_error: str

    @property
    def message(self) -> str:
        return str(self.error())

    def error(self) -> RoleFailed:
        return RoleFailed(self.role, self.used, self.limit, self.last_error)


@dataclass(frozen=True)
class StopOnConfig:
    """The run ends on a failure the configuration causes (a restart would fail the same way)."""

    role: str
    message: str
    key: str
    log_path: str | None = None


Decision = (
    LeaveToRay
    | WaitForStore
    | RestartRole
    | DropSampler
    | ReconcileLearner
    | RestartLearner
    | Stop
    | StopOnConfig
)


@dataclass
class Budgets:
    """Restarts used so far, per role (per slot for the samplers); the driver owns it and counts what it
    applied (`record`); `decide` only reads it."""

    limits: dict[str, int]
    used_by: dict[tuple[str, int], RestartBudget] = field(default_factory=dict)

    @classmethod
    def from_limits(cls, *, learner: int, store: int, backup: int, sampler: int) -> Budgets:
        limits = {"learner": learner, "store": store, "backup": backup, "sampler": sampler}
        return cls({**limits, "retrieval": RETRIEVAL_RESTARTS})

    def budget(self, role: str, index: int = 0) -> RestartBudget:
        key = (role, index if role == "sampler" else 0)
        if key not in self.used_by:
            self.used_by[key] = RestartBudget(role, self.limits[role])
        return self.used_by[key]

    def used(self, role: str, index: int = 0) -> int:
        key = (role, index if role == "sampler" else 0)
        return self.used_by[key].used if key in self.used_by else 0

    def record(self, role: str, index: int, cause: str) -> int:
        """Counts one restart the driver applied; its number (1, 2, ...)."""
        return self.budget(role, index).record(cause)


def _restart_or_stop(role: str, index: int, cause: str, budgets: Budgets, backoff: bool) -> Decision:
    used, limit = budgets.used(role, index), budgets.limits[role]
    if used >= limit:
        return Stop(role, used, limit, cause)
    attempt = used + 1
    if role == "learner":
        return RestartLearner(attempt, backoff_s(attempt), cause)
    return RestartRole(role, index, attempt, backoff_s(attempt) if backoff else 0.0, cause)


def _sampler(f: Failure, budgets: Budgets) -> Decision:
    if f.kind == "config" and f.key is not None:
        return StopOnConfig(f.role, f.cause, f.key, f.log_path)
    if f.kind == "died" and f.role == "sampler":  # Ray restarts it in place, as under RLlib's manager
        return LeaveToRay("sampler", f.index, f.cause)
    if budgets.used("sampler", f.index) >= budgets.limits["sampler"]:
        return DropSampler(f.index, f.cause)
    return _restart_or_stop("sampler", f.index, f.cause, budgets, backoff=False)  # its endpoint with it


def decide(failure: Failure, budgets: Budgets) -> Decision:
    """The one decision for `failure` given the restarts used so far (module docstring's table)."""
    f = failure
    if f.role in ("sampler", "endpoint"):
        return _sampler(f, budgets)
    if f.role == "store":
        if f.kind == "unavailable":  # dead for good, or no answer within the wait: Ray will not bring it back
            return Stop("store", budgets.used("store"), budgets.limits["store"], f.cause)
        return WaitForStore(f.cause)
    if f.kind == "store-lost" and f.role == "backup":
        return WaitForStore(f.cause)
    if f.role == "learner":
        if f.kind == "store-lost" and learner_action("store", f.ranks) == "reconcile":
            return ReconcileLearner(f.cause)
        return _restart_or_stop("learner", 0, f.cause, budgets, backoff=True)
    return _restart_or_stop(f.role, 0, f.cause, budgets, backoff=False)  # backup, retrieval


def limit_key(role: str) -> str:
    """The config key that holds `role`'s budget (as the Stop message names it)."""
    return LIMIT_KEYS.get(role, "its restart limit")
