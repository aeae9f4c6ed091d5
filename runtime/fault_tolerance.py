"""Self-healing roles on Ray (docs/design.md §14): `FaultTolerance`, the one object that owns the run's
failure state — restart budgets and counts, the batch events, the last errors, the store's pid — turns each
error of every role into a typed failure (runtime/decisions.py), asks the pure `decide`, and carries the
decision out through runtime/roles.py:Roles. Nothing else writes its state
(tests/unit/test_fault_tolerance.py).

    ft = FaultTolerance(cfg, roles)                  # the driver holds one (runtime/driver.py)
    resync = ft.failed("learner", error, step)       # observe → decide → apply; a Resync for the driver
    ft.check_store(step); ft.check_samplers(step); ft.check_retrieval(step)   # the driver's flush
    ft.metrics(); ft.summary()                       # supervision/restarts_<role>, the batch events

Every restart is a log line naming the role and its cause, and a metric; a stop is one line (`RoleFailed`, or
a ConfigError naming the key).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import ray

from actors.failures import SamplerFailure, from_ray_error
from configs.schema import Config, ConfigError
from runtime import decisions as d
from runtime.learner_group import LearnerRankError
from runtime.pools import gcs_restarts
from runtime.roles import Roles
from runtime.signals import Abort
from runtime.store_client import StoreGone, StoreLink, one_line, store_pid
from system.roles import HostRole, LearnerRole, RetrievalRole, StoreRole

log = logging.getLogger("treeopsd.supervision")
LEARNER_PING_S = 60.0
ENDPOINT_SIGNS = ("agent endpoint", "agent_port")  # actors/external/endpoint.py's own failures
FAILED: dict[str, Callable[..., d.Failure]] = {t.role: t for t in get_args(d.Failure)}  # role -> its type


class Observed(RuntimeError):
    """A failure the run observed itself, already of a kind: a kept learner that does not answer
    ("unreconciled"), a restart that did not start ("start-failed"), a final checkpoint that failed every
    time ("final-checkpoint"), no healthy sampler for `sampler.unhealthy_grace_s` ("none-healthy")."""

    def __init__(self, kind: str, cause: str) -> None:
        super().__init__(cause)
        self.kind = kind


@dataclass(frozen=True)
class Resync:
    """What the driver's own state follows after a learner decision."""

    version: int  # the learner's version: the driver's step from now on
    step_metrics: dict[str, float] | None = None  # step `version` trained but its call failed: log these


class FaultTolerance:
    """The run's failure state and the one way to act on a failure (module docstring)."""

    def __init__(self, cfg: Config, roles: Roles) -> None:
        self.cfg, self.roles = cfg, roles
        r = cfg.run
        self._budgets = d.Budgets.from_limits(
            learner=r.max_learner_restarts,
            store=r.max_store_restarts,
            backup=r.max_backup_restarts,
            sampler=cfg.sampler.max_restarts,
        )
        self._restarts: Counter[str] = Counter()
        self._step_retries = 0  # learner steps tried again after the store was lost under them
        self._events: list[tuple[str, int]] = []  # what the model holds (runtime/decisions.py)
        self._last_store_error = ""
        self._store_pid: int | None = None
        self._sampler_failures = 0
        self._last_sampler_error: str | None = None  # root cause and log file, for the final message
        self._last_healthy = time.perf_counter()
        self._step = 0  # the driver's step when the last failure came (a store lost under a store call)
        self.store = StoreLink(roles.store, on_lost=self._store_lost)

    # ---- the one entry ----------------------------------------------------------------------------------
    def failed(
        self, role: str, error: BaseException, step: int, actor_id: int | None = None
    ) -> Resync | None:
        """A role's call failed with `error` (a sampler's: `actor_id`): decided and carried out; a Resync when
        the learner's version is the driver's step now. Raises when the decision is to stop."""
        self._step = step
        if role == "sampler":
            self._sampler_failures += 1
            self.store.call(StoreRole.release, self.cfg.sampler.prompts_per_request)  # its reservation back
        return self._act(self._observe(role, error, actor_id))

    def _store_lost(self, error: BaseException) -> None:
        """The store client's `on_lost`: Ray restarts the store in place; waited for (or a stop)."""
        self._act(self._observe("store", error, None))

    def _observe(self, role: str, e: BaseException, actor_id: int | None) -> d.Failure:
        cause, key = one_line(e), _config_key(e)
        if role == "sampler":
            return self._sampler_failure(e, actor_id)
        if role == "run":
            return d.RunFailed("interrupted", str(e), getattr(e, "signum", 2))
        if key is not None:
            return FAILED[role]("config", cause, key=key)
        if role == "store":  # Ray restarts it in place; StoreGone: it will not
            if isinstance(e, StoreGone):
                return d.StoreFailed("unavailable", self._last_store_error or cause)
            self._last_store_error = cause
            return d.StoreFailed("died", cause)
        if role == "retrieval":
            return d.RetrievalFailed("died", cause)
        if role == "backup":
            return d.BackupFailed(_kind(e), cause)
        return self._learner_failure(e, cause)

    def _learner_failure(self, e: BaseException, cause: str) -> d.LearnerFailed:
        ranks = self.cfg.learner.ranks
        if isinstance(e, Observed) and e.kind in get_args(d.LearnerKind):
            return d.LearnerFailed(e.kind, str(e), ranks)  # type: ignore[arg-type]
        if "Address already in use" in str(e):
            return d.LearnerFailed("port-taken", cause, ranks)
        kind = _kind(e)
        log.warning("learner step failed (%s): %s", kind, cause)
        if kind == "raised":  # its own exception: the whole remote traceback, for the bug report
            log.warning("%s", e)
        return d.LearnerFailed(kind, cause, ranks)

    def _sampler_failure(self, e: BaseException, actor_id: int | None) -> d.SamplerFailed:
        if isinstance(e, Observed):
            return d.SamplerFailed("none-healthy", str(e))
        explained, by_sampler = from_ray_error(e, self.cfg)
        text = str(explained)
        log.warning("sampler %s failed: %s", actor_id, text)
        self._last_sampler_error = text
        kind: d.SamplerKind = "raised"
        if by_sampler and explained.is_config:
            kind = "config"
        elif not isinstance(e, ray.exceptions.RayTaskError):  # its process is gone: Ray restarts it
            kind = "died"
        elif any(s in text for s in ENDPOINT_SIGNS):
            kind = "endpoint"
        slot = self.roles.slots.get(actor_id, -1) if actor_id is not None else -1
        retiring = actor_id in self.roles.retiring
        return d.SamplerFailed(kind, text, slot, retiring, explained.key, explained.log_path)

    def _act(self, failure: d.Failure) -> Resync | None:
        decision = d.decide(failure, self._budgets)
        log.info("%s -> %s", failure, decision)
        return self._apply(decision)

    def _apply(self, decision: d.Decision) -> Resync | None:
        roles, step = self.roles, self._step
        match decision:
            case d.LeaveToRay():
                return None
            case d.WaitForStore():
                self.check_store(step)
                return None
            case d.RestartRole(role="backup"):
                self._count("backup", 0, decision.cause)
                roles.restart_backup()
                return None
            case d.RestartRole(role="sampler"):
                self._count("sampler", decision.index, decision.cause)
                roles.replace_sampler(roles.actor_in_slot(decision.index))  # its state: untrusted
                return None
            case d.RestartRole(role="retrieval"):
                self._count("retrieval", 0, decision.cause)
                roles.restart_retrieval()
                roles.replace_all_samplers()  # the new service has a new URL
                return None
            case d.DropSampler():
                why = "retiring" if decision.retiring else "past sampler.max_restarts"
                log.warning("sampler %d is %s: removed (%s)", decision.index, why, decision.cause)
                roles.remove_sampler(roles.actor_in_slot(decision.index))
                return None
            case d.ReconcileLearner():
                return self._reconcile(step, decision.cause)
            case d.RestartLearner():
                self._count("learner", 0, decision.cause)
                time.sleep(decision.backoff_s)
                roles.stop_learners()
                return self._start_learner(step, free_port=False)
            case d.MoveLearnerPort():
                log.warning("the weight port is taken: the learner restarts on a free one")
                return self._start_learner(step, free_port=True)
            case d.Stop():
                raise decision.error()
            case d.StopOnConfig():
                raise ConfigError(decision.message)  # `treeopsd train` prints it, exit 2
            case d.StopNow():
                roles.stop_now()
                raise Abort(decision.signum)
        raise TypeError(f"no way to apply {decision!r}")

    # ---- the store ----------------------------------------------------------------------------------------
    def check_store(self, step: int) -> None:
        """Waits until the store answers; a new pid means Ray restarted it: counted, and the learner's version
        told again (a reopened store starts at version 0, which would shut admission)."""
        self._step = step
        try:
            pid, seen = store_pid(self.roles.store)
        except StoreGone as e:
            self._act(self._observe("store", e, None))  # a Stop: raises
            raise
        self._last_store_error = self._last_store_error or seen
        if self._store_pid is None or pid == self._store_pid:
            self._store_pid = pid
            return
        self._store_pid = pid
        store_id = ray.get(self.roles.store.host(HostRole.actor_id))
        n = max(1, (gcs_restarts(store_id) or 0) - self._restarts["store"])  # killed while restarting
        cause = self._last_store_error or "its process exited"
        self._budgets.record("store", 0, cause, n)  # Ray holds their limit: counted only
        self._restarted("store", cause, n)
        self._last_store_error = ""
        ray.get(self.roles.store.call(StoreRole.set_learner_version, step))

    # ---- the learner --------------------------------------------------------------------------------------
    def _reconcile(self, step: int, cause: str) -> Resync | None:
        """Keeps the live learner: the store goes back to the learner's version (watermark = version: one
        batch per step); a learner that does not answer, or a store behind it, is a failure of its own."""
        self._last_store_error = cause
        self.check_store(step)
        try:
            version = int(
                ray.get(self.roles.learner.call(LearnerRole.progress), timeout=LEARNER_PING_S)["version"]
            )
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.info("the kept learner does not answer: %s", one_line(e))
            return self._act(self._observe("learner", Observed("unreconciled", cause), None))
        watermark = int(ray.get(self.roles.store.call(StoreRole.watermark)))
        if watermark < version:
            return self._act(self._observe("learner", Observed("unreconciled", cause), None))
        if watermark > version:
            ray.get(self.roles.store.call(StoreRole.rewind_to, version))
        self._step_retries += 1
        return self._resync(step, version)

    def _start_learner(self, step: int, free_port: bool) -> Resync | None:
        """Starts the learner group again from its newest checkpoint (the store rewound to its watermark; to 0
        when there is none); a start that fails is a failure of its own."""
        self.check_store(step)
        try:
            if self.roles.restart_learners(free_port):
                self.roles.replace_all_samplers()  # subscribed to an endpoint that is gone
            version = int(ray.get(self.roles.learner.call(LearnerRole.progress))["version"])
        except (ray.exceptions.RayError, LearnerRankError) as e:
            taken = "Address already in use" in str(e) and not free_port
            error = e if taken else Observed("start-failed", f"restart failed: {one_line(e)}")
            return self._act(self._observe("learner", error, None))
        if version == 0:  # no checkpoint: the new learner holds none of the batches handed out
            ray.get(self.roles.store.call(StoreRole.rewind_to, 0))
        return self._resync(step, version)

    def _last_step_metrics(self, version: int) -> dict[str, float] | None:
        """The learner's own record of step `version` (None when it has none, or does not answer)."""
        try:
            last = ray.get(self.roles.learner.call(LearnerRole.last_step_metrics), timeout=LEARNER_PING_S)
        except (ray.exceptions.RayError, TimeoutError):
            return None
        return last if last is not None and int(last["learner/version"]) == version else None

    def _resync(self, step: int, version: int) -> Resync:
        """The store and the batch events agree on the learner's `version` again; the driver follows."""
        last = None
        if version > step:  # trained, but the call carrying the metrics failed
            last = self._last_step_metrics(version)
            kept = None if last is None else int(last["learner/batch_index"])
            self._events += d.catch_up_events(step, version, kept)
        elif version < step:  # restarted from an older checkpoint: later batches are trained again
            self._events.append(("rewind", version))
        ray.get(self.roles.store.call(StoreRole.set_learner_version, version))
        return Resync(version, last)

    def trained(self, out: dict[str, Any]) -> None:
        """A learner step's metrics arrived: batch `learner/batch_index` is trained."""
        self._events.append(("trained", int(out["learner/batch_index"])))

    # ---- health checks ----------------------------------------------------------------------------------
    def check_samplers(self, step: int) -> None:
        """Stops the run, instead of waiting forever, when no sampler has been healthy for
        `sampler.unhealthy_grace_s`, naming the last failure's root cause and log file."""
        now, grace_s = time.perf_counter(), self.cfg.sampler.unhealthy_grace_s
        if self.roles.healthy_samplers():
            self._last_healthy = now
        elif now - self._last_healthy > grace_s:
            cause = self._last_sampler_error or f"no failure reported; see {self.cfg.run.run_dir}/logs"
            self._step = step
            self._act(
                self._observe("sampler", Observed("none-healthy", f"for {grace_s:.0f} s: {cause}"), None)
            )

    def check_retrieval(self, step: int) -> None:
        """A retrieval service whose actor died is a failure (a stopped server whose actor lives is not: the
        samplers' searches fail as tool errors)."""
        if self.roles.retrieval is None:
            return
        try:
            ray.get(self.roles.retrieval.call(RetrievalRole.describe), timeout=10)
        except ray.exceptions.RayActorError as e:
            self.failed("retrieval", e, step)
        except ray.exceptions.GetTimeoutError:
            log.info("the retrieval service did not answer within 10 s")

    @property
    def sampler_failures(self) -> int:
        return self._sampler_failures

    # ---- counts -------------------------------------------------------------------------------------------
    def _count(self, role: str, index: int, cause: str) -> None:
        self._budgets.record(role, index, cause)
        self._restarted(role, cause)

    def _restarted(self, role: str, cause: str, n: int = 1) -> None:
        self._restarts[role] += n
        limit = self._budgets.limits.get(role, "?")
        log.warning("restarting the %s (%d of %s): %s", role, self._restarts[role], limit, cause)

    def metrics(self) -> dict[str, float]:
        roles = ("learner", "store", "backup", "sampler", "retrieval")  # sampler: replaced by Roles, not Ray
        out = {f"supervision/restarts_{role}": float(self._restarts[role]) for role in roles}
        out["supervision/learner_step_retries"] = float(self._step_retries)
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "restarts": dict(self._restarts),
            "learner_step_retries": self._step_retries,
            "sampler_failures": self._sampler_failures,
            "sampler_restarts": self._sampler_restarts(),  # Ray's own count where it has one
            "batch_events": list(self._events),  # faults/audit.py audits them
        }

    def _sampler_restarts(self) -> int:
        """Ray's count (GCS) over the samplers the run has now, or RLlib's manager's when Ray does not say
        (it sees only restarts of samplers it had marked unhealthy)."""
        counts = [gcs_restarts(i) for i in self.roles.ask_samplers(HostRole.actor_id).values()]
        seen = self.roles.samplers_restarted()
        return seen if None in counts else max(seen, sum(c for c in counts if c is not None))


def _kind(e: BaseException) -> d.BackupKind:
    """A Ray error's kind: a task error whose cause is a lost actor is "store-lost" (the store: the only actor
    the roles call); a RayActorError otherwise means the actor itself died."""
    if isinstance(e, LearnerRankError):
        return "died" if " died " in str(e) else "raised"
    if not isinstance(e, ray.exceptions.RayTaskError):
        return "died"
    return "store-lost" if isinstance(getattr(e, "cause", None), ray.exceptions.RayActorError) else "raised"


def _config_key(e: BaseException) -> str | None:
    """The config key when the configuration caused `e` (a ConfigError, or a SamplerFailure naming one)."""
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, SamplerFailure):
        return cause.key
    if isinstance(cause, ConfigError):  # "learner.ranks = 3 is invalid: ..." names its key first
        head = str(cause).split(" ", 1)[0]
        return getattr(cause, "key", None) or (head if "." in head else "?")
    return None
