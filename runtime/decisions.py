"""What the run does when a role fails, as one pure function: `decide(failure, budgets) -> Decision`. No Ray
and no writes here: runtime/fault_tolerance.py turns an error into a failure, carries the decision out
through runtime/roles.py:Roles, and owns the budgets and the batch events this module only reads.

    budgets = Budgets.from_limits(learner=3, store=3, backup=10, sampler=3)
    decide(BackupFailed("died", "its worker process exited"), budgets)
        # RestartRole(role="backup", index=0, attempt=1, backoff_s=0.0, cause=...)

Each role has its own failure type and kinds, so a pair no role produces cannot be written; "config" means
one thing for every role: the configuration causes it (`key`), the run stops with one line naming the key.

| failure (kind)                                | decision                                                  |
|-----------------------------------------------|-----------------------------------------------------------|
| any role: config                              | StopOnConfig: one line naming the key                     |
| sampler died                                  | LeaveToRay: Ray restarts it (`sampler.max_restarts`)      |
| sampler raised / its agent endpoint failed    | RestartRole("sampler", slot): Roles replaces it           |
| ... retiring, or past `sampler.max_restarts`  | DropSampler: removed, the run goes on with the others     |
| sampler none-healthy (for its grace period)   | Stop naming the last sampler failure                      |
| store died (Ray restarts it in place)         | WaitForStore                                              |
| store unavailable (Ray's restarts used up)    | Stop naming `run.max_store_restarts`                      |
| backup store-lost                             | WaitForStore                                              |
| backup died / raised                          | RestartRole("backup") within `run.max_backup_restarts`    |
| learner store-lost, 1 rank                    | ReconcileLearner: keep it, rewind the store to its version |
| learner port-taken (its weight port is held)  | MoveLearnerPort: start it on a free port                  |
| learner final-checkpoint (failed every time)  | Stop naming `run.max_learner_restarts`                    |
| learner any other kind, or sharded            | RestartLearner within `run.max_learner_restarts`          |
| retrieval died                                | RestartRole("retrieval") within `RETRIEVAL_RESTARTS`      |
| run interrupted (a second SIGINT/SIGTERM)     | StopNow: every actor killed at once                       |
| any role past its budget                      | Stop: one line, the role, its limit key, last error       |

The batch events (`catch_up_events`; faults/audit.py audits them): `("trained", k)` a step on batch k whose
metrics arrived, `("unlogged", k)` batch k trained but its metrics lost with a failed call, `("rewind", w)`
the model rolled back to its state after w batches (a learner restarted from the checkpoint of step w).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args, get_type_hints

LIMIT_KEYS = {
    "learner": "run.max_learner_restarts",
    "store": "run.max_store_restarts",
    "backup": "run.max_backup_restarts",
    "sampler": "sampler.max_restarts",
}
RETRIEVAL_RESTARTS = 3  # the service is stateless (its index is on disk); no config key holds this yet

SamplerKind = Literal["died", "raised", "endpoint", "config", "none-healthy"]
StoreKind = Literal["died", "unavailable", "config"]
BackupKind = Literal["died", "raised", "store-lost", "config"]
LearnerKind = Literal[
    "died", "raised", "store-lost", "config", "start-failed", "unreconciled", "port-taken", "final-checkpoint"
]
RetrievalKind = Literal["died", "config"]
RunKind = Literal["interrupted"]


class _Kinds:
    """A failure whose `kind` is not one of its role's (mypy refuses it; so does this, at run time)."""

    role: ClassVar[str]
    kind: Any

    def __post_init__(self) -> None:
        kinds = get_args(get_type_hints(type(self))["kind"])
        if self.kind not in kinds:
            raise ValueError(f"{type(self).__name__} has no kind {self.kind!r}: only {', '.join(kinds)}")


@dataclass(frozen=True)
class SamplerFailed(_Kinds):
    """`slot`: the sampler's slot (its log file's number); `retiring`: scaled down, on its way out."""

    role = "sampler"
    kind: SamplerKind
    cause: str  # one line: the exception type and its message
    slot: int = 0
    retiring: bool = False
    key: str | None = None  # the config key to blame (kind "config")
    log_path: str | None = None  # the sampler's log file, where the failure names one


@dataclass(frozen=True)
class StoreFailed(_Kinds):
    role = "store"
    kind: StoreKind
    cause: str
    key: str | None = None


@dataclass(frozen=True)
class BackupFailed(_Kinds):
    role = "backup"
    kind: BackupKind
    cause: str
    key: str | None = None


@dataclass(frozen=True)
class LearnerFailed(_Kinds):
    """`ranks`: the learner's ranks (a sharded group is never kept: its other ranks sit in a collective)."""

    role = "learner"
    kind: LearnerKind
    cause: str
    ranks: int = 1
    key: str | None = None


@dataclass(frozen=True)
class RetrievalFailed(_Kinds):
    role = "retrieval"
    kind: RetrievalKind
    cause: str
    key: str | None = None


@dataclass(frozen=True)
class RunFailed(_Kinds):
    """The run itself: a second SIGINT/SIGTERM, or a step that did not end after the first (`signum`)."""

    role = "run"
    kind: RunKind
    cause: str
    signum: int = 2


Failure = SamplerFailed | StoreFailed | BackupFailed | LearnerFailed | RetrievalFailed | RunFailed


class RoleFailed(RuntimeError):
    """The run stops on a role's failure (past its budget, or one no restart mends); one line."""

    def __init__(self, message: str, role: str, last_error: str) -> None:
        super().__init__(message)
        self.role, self.last_error = role, last_error


@dataclass(frozen=True)
class LeaveToRay:  # Ray restarts the actor in place (its `max_restarts`); nothing else is done
    role: str
    index: int
    cause: str


@dataclass(frozen=True)
class WaitForStore:  # until the store answers; a new pid is a restart: counted, told the learner's version
    cause: str


@dataclass(frozen=True)
class RestartRole:  # Roles stops the actor (if it still lives) and starts a new one
    role: str
    index: int
    attempt: int  # 1, 2, ... within the role's budget
    backoff_s: float
    cause: str


@dataclass(frozen=True)
class DropSampler:  # a sampler past its restarts, or a retiring one that failed: removed, the others go on
    index: int
    cause: str
    retiring: bool = False


@dataclass(frozen=True)
class ReconcileLearner:  # keep the live learner (its model is whole), rewind the store to its version
    cause: str


@dataclass(frozen=True)
class RestartLearner:  # stop every rank, start the group again from its newest checkpoint after `backoff_s`
    attempt: int
    backoff_s: float
    cause: str


@dataclass(frozen=True)
class MoveLearnerPort:  # the restarted learner's weight port is still held: a free one (restart counted)
    cause: str


@dataclass(frozen=True)
class Stop:
    """The run ends: the role failed once more than its budget allows (or, `why`, in a way none mends)."""

    role: str
    used: int
    limit: int
    last_error: str
    why: str | None = None

    @property
    def message(self) -> str:
        if self.why is not None:
            return f"{self.why}: {self.last_error}"
        key = LIMIT_KEYS.get(self.role, "its restart limit")
        used = f"{self.used} of {key} = {self.limit}"
        return f"the {self.role} failed and its restarts are used up ({used}); last error: {self.last_error}"

    def error(self) -> RoleFailed:
        return RoleFailed(self.message, self.role, self.last_error)


@dataclass(frozen=True)
class StopOnConfig:  # the configuration causes the failure: the run ends with one line naming `key`
    role: str
    message: str
    key: str
    log_path: str | None = None


@dataclass(frozen=True)
class StopNow:  # every actor of the run killed at once (what they wrote is atomic); exit 128 + `signum`
    signum: int
    cause: str


Decision = (
    LeaveToRay
    | WaitForStore
    | RestartRole
    | DropSampler
    | ReconcileLearner
    | RestartLearner
    | MoveLearnerPort
    | Stop
    | StopOnConfig
    | StopNow
)


@dataclass
class Budgets:
    """Restarts used so far, per role (per slot for the samplers), with their causes; only the fault tolerance
    writes them (`record`), `decide` reads them."""

    limits: dict[str, int]
    causes: dict[tuple[str, int], list[str]] = field(default_factory=dict)

    @classmethod
    def from_limits(cls, *, learner: int, store: int, backup: int, sampler: int) -> Budgets:
        limits = {"learner": learner, "store": store, "backup": backup, "sampler": sampler}
        return cls({**limits, "retrieval": RETRIEVAL_RESTARTS})

    def used(self, role: str, index: int = 0) -> int:
        return len(self.causes.get((role, index if role == "sampler" else 0), []))

    def record(self, role: str, index: int, cause: str, n: int = 1) -> int:
        """Counts `n` restarts (one applied, or Ray's own); never refuses: `decide` stops. The count now."""
        causes = self.causes.setdefault((role, index if role == "sampler" else 0), [])
        causes.extend([cause] * n)
        return len(causes)


def backoff_s(attempt: int, base_s: float = 1.0, cap_s: float = 30.0) -> float:
    """Pause before restart number `attempt` (1-based): base·2^(attempt−1), at most `cap_s`; a role that keeps
    dying at start does not spin the cluster."""
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    return min(cap_s, base_s * 2.0 ** (attempt - 1))


def _restart_or_stop(role: str, index: int, cause: str, budgets: Budgets) -> Decision:
    used, limit = budgets.used(role, index), budgets.limits[role]
    if used >= limit:
        return Stop(role, used, limit, cause)
    if role == "learner":
        return RestartLearner(used + 1, backoff_s(used + 1), cause)
    return RestartRole(role, index, used + 1, 0.0, cause)


def _sampler(f: SamplerFailed, budgets: Budgets) -> Decision:
    if f.kind == "died":  # Ray restarts it in place, as under RLlib's manager
        return LeaveToRay("sampler", f.slot, f.cause)
    if f.kind == "none-healthy":
        used, limit = budgets.used("sampler", f.slot), budgets.limits["sampler"]
        return Stop("sampler", used, limit, f.cause, why="no healthy sampler (restarts exhausted)")
    if f.retiring or budgets.used("sampler", f.slot) >= budgets.limits["sampler"]:
        return DropSampler(f.slot, f.cause, f.retiring)
    return _restart_or_stop("sampler", f.slot, f.cause, budgets)  # its agent endpoint with it


def _learner(f: LearnerFailed, budgets: Budgets) -> Decision:
    if f.kind == "store-lost" and f.ranks == 1:  # the store calls sit before and after the training part
        return ReconcileLearner(f.cause)
    if f.kind == "port-taken":
        return MoveLearnerPort(f.cause)
    if f.kind == "final-checkpoint":
        return Stop("learner", budgets.used("learner"), budgets.limits["learner"], f.cause)
    return _restart_or_stop("learner", 0, f.cause, budgets)


def decide(failure: Failure, budgets: Budgets) -> Decision:
    """The one decision for `failure` given the restarts used so far (module docstring's table)."""
    f = failure
    if f.kind == "config":
        return _config(f)
    match f:
        case SamplerFailed():
            return _sampler(f, budgets)
        case StoreFailed(kind="unavailable"):  # dead for good: Ray will not bring it back
            return Stop("store", budgets.used("store"), budgets.limits["store"], f.cause)
        case StoreFailed() | BackupFailed(kind="store-lost"):
            return WaitForStore(f.cause)
        case LearnerFailed():
            return _learner(f, budgets)
        case RunFailed():
            return StopNow(f.signum, f.cause)
    return _restart_or_stop(f.role, 0, f.cause, budgets)  # backup, retrieval


def _config(f: Failure) -> StopOnConfig:
    key = getattr(f, "key", None) or "?"
    line = f.cause if f"[config key: {key}]" in f.cause else f"{f.cause} [config key: {key}]"
    return StopOnConfig(f.role, line, key, getattr(f, "log_path", None))


def catch_up_events(logged: int, version: int, kept_batch: int | None) -> list[tuple[str, int]]:
    """Batch events for steps logged + 1 .. version, trained though the calls that carried their metrics
    failed: each batch `("unlogged", k)`, except the newest when the learner kept that step's metrics
    (`kept_batch`, its batch index): then `("trained", kept_batch)`, as if its call had returned."""
    last = version - (kept_batch is not None)
    events = [("unlogged", k) for k in range(logged, last)]
    return events + ([("trained", kept_batch)] if kept_batch is not None and version > logged else [])
