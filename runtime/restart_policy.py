"""What the supervisor decides when a role fails, as pure functions (no Ray; runtime/supervision.py acts).

    budget = RestartBudget("learner", limit=cfg.run.max_learner_restarts)
    budget.record("its worker process exited")     # 1; raises RoleFailed once the limit is used up
    time.sleep(backoff_s(1))                       # 1 s, then 2, 4, ... capped at 30
    learner_action("store", ranks=1)               # "reconcile": keep the live learner, rewind the store
    batch_audit([("trained", 0), ("rewind", 0), ("trained", 0)], steps=1)   # nothing twice, nothing skipped
    catch_up_events(logged=5, version=7, kept_batch=6)   # [("unlogged", 5), ("trained", 6)]

The batch events are the driver's view of what the model holds: `("trained", k)` a step on batch k whose
metrics arrived, `("unlogged", k)` batch k trained but its metrics lost with a failed call (the learner's
version says it was trained), `("rewind", w)` the model rolled back to its state after w batches (a learner
restarted from the checkpoint of step w): every batch ≥ w is undone and trained again later.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

LIMIT_KEYS = {
    "learner": "run.max_learner_restarts",
    "store": "run.max_store_restarts",
    "backup": "run.max_backup_restarts",
    "sampler": "sampler.max_restarts",
}


class RoleFailed(RuntimeError):
    """A role failed once more than its restart budget allows; the message names it and its last error."""

    def __init__(self, role: str, used: int, limit: int, last_error: str) -> None:
        key = LIMIT_KEYS.get(role, "its restart limit")
        super().__init__(
            f"the {role} failed and its restarts are used up ({used} of {key} = {limit}); "
            f"last error: {last_error}"
        )
        self.role, self.last_error = role, last_error


@dataclass
class RestartBudget:
    """At most `limit` restarts of one role in one run; the causes, newest last, for the final message."""

    role: str
    limit: int
    causes: list[str] = field(default_factory=list)

    @property
    def used(self) -> int:
        return len(self.causes)

    def record(self, cause: str) -> int:
        """Counts one restart and returns its number (1, 2, ...); RoleFailed when none is left."""
        if self.used >= self.limit:
            raise RoleFailed(self.role, self.used, self.limit, cause)
        self.causes.append(cause)
        return self.used


def backoff_s(attempt: int, base_s: float = 1.0, cap_s: float = 30.0) -> float:
    """Pause before restart number `attempt` (1-based): base·2^(attempt−1), at most `cap_s`; a role that keeps
    dying at start does not spin the cluster."""
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    return min(cap_s, base_s * 2.0 ** (attempt - 1))


def failure_kind(task_error: bool, cause_is_actor_error: bool) -> str:
    """What failed: "died" (the role's own process is gone), "store" (its call raised because an actor it
    called, the store, was lost under it) or "raised" (its own code raised)."""
    if not task_error:
        return "died"
    return "store" if cause_is_actor_error else "raised"


def learner_action(kind: str, ranks: int) -> str:
    """The action: "reconcile" keeps a single live learner whose step failed only because the store was
    lost (its model is whole: the store calls sit before and after the training part); anything else — a
    dead process, its own exception, any failure of a sharded group (the other ranks are left inside a
    collective) — is "restart": the learner starts again from its newest checkpoint."""
    return "reconcile" if kind == "store" and ranks == 1 else "restart"


def trained_batches(events: Sequence[tuple[str, int]]) -> list[int]:
    """The batch indices the model holds, in training order, after applying the rewinds."""
    out: list[int] = []
    for op, k in events:
        if op in ("trained", "unlogged"):
            out.append(k)
        elif op == "rewind":
            out = [b for b in out if b < k]
        else:
            raise ValueError(f"unknown batch event {op!r}")
    return out


def batch_audit(events: Sequence[tuple[str, int]], steps: int) -> dict[str, list[int] | int]:
    """Batches trained twice and batches skipped on the way to `steps` steps (both empty in a sound run)."""
    held = trained_batches(events)
    counts = Counter(held)
    return {
        "trained": len(held),
        "twice": sorted(k for k, c in counts.items() if c > 1),
        "skipped": sorted(set(range(steps)) - set(counts)),
        "unlogged": sorted(k for op, k in events if op == "unlogged"),
    }


def catch_up_events(logged: int, version: int, kept_batch: int | None) -> list[tuple[str, int]]:
    """Batch events for steps logged + 1 .. version, trained though the calls that carried their metrics
    failed: each batch `("unlogged", k)`, except the newest when the learner kept that step's metrics
    (`kept_batch`, its batch index): then `("trained", kept_batch)`, as if its call had returned."""
    last = version - (kept_batch is not None)
    events = [("unlogged", k) for k in range(logged, last)]
    return events + ([("trained", kept_batch)] if kept_batch is not None and version > logged else [])


def resume_command(argv: Sequence[str], run_dir: str) -> str:
    """The command line that continues this run: the same arguments with --resume (and the run directory)."""
    args = [a for a in argv if a != "--resume"]
    args = args[1:] if args[:1] == ["train"] else args  # sys.argv[1:] starts with the subcommand
    if not any(a == "--run-dir" or a.startswith(("--run-dir=", "run.run_dir=")) for a in args):
        args += ["--run-dir", run_dir]
    return shlex.join(["treeopsd", "train", "--resume", *args])


def rss_slope_mb_per_min(samples: Sequence[tuple[float, float]], warmup_s: float) -> float | None:
    """Least-squares slope of resident memory (bytes) over time (seconds) after `warmup_s`, in MB/min;
    None with fewer than 3 samples past the warm-up."""
    pts = [(t, b) for t, b in samples if t >= warmup_s]
    if len(pts) < 3:
        return None
    n = len(pts)
    mt, mb = sum(t for t, _ in pts) / n, sum(b for _, b in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    if var == 0:
        return None
    slope = sum((t - mt) * (b - mb) for t, b in pts) / var  # bytes per second
    return slope * 60.0 / 1e6
