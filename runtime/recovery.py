"""How the driver applies a decision (runtime/decisions.py) after a role failed: through `Roles` (the only
code that starts, replaces or stops actors), the store client and the learner's own record.

    recovery = Recovery(cfg, roles, supervisor, step=lambda: driver.step)   # the driver holds one
    resync = recovery.apply(decision, step)          # a `Resync` after a learner decision, else None
    recovery.check_store(step)                       # the store restarted by Ray: counted, told the version

A learner decision ends in a `Resync` for the driver's own state (its step, its progress, its samplers): the
learner's version is the step from now on, and the samplers follow a weight endpoint that moved.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from actors.failures import SamplerConfigFailure
from configs.schema import Config
from runtime.decisions import (
    Decision,
    DropSampler,
    Failure,
    LeaveToRay,
    ReconcileLearner,
    RestartLearner,
    RestartRole,
    Stop,
    StopOnConfig,
    WaitForStore,
)
from runtime.learner_group import LearnerRankError
from runtime.restart_policy import RoleFailed, catch_up_events
from runtime.roles import Roles
from runtime.store_client import StoreGone, StoreLink, store_pid
from runtime.supervision import Supervisor, brief, gcs_restarts

log = logging.getLogger("treeopsd.supervision")
LEARNER_PING_S = 60.0


@dataclass(frozen=True)
class Resync:
    """What the driver's own state follows after a learner decision (`Driver.apply`)."""

    version: int  # the learner's version: the driver's step from now on
    step_metrics: dict[str, float] | None = None  # step `version` trained but its call failed: log these
    replace_samplers: bool = False  # the weight endpoint (or the retrieval URL) moved: new samplers


class Recovery:
    """Applies decisions for one driver; the store client with the run's one retry policy (`store`)."""

    def __init__(self, cfg: Config, roles: Roles, supervisor: Supervisor, step: Callable[[], int]) -> None:
        self.cfg, self.roles, self.sup = cfg, roles, supervisor
        self.step = step  # the driver's step, for a store lost under a call (`_store_lost`)
        self.store = StoreLink(roles.store, on_lost=self._store_lost)
        self.store_pid = self._wait_store()

    def apply(self, decision: Decision, step: int) -> Resync | None:
        """Carries out `decision`; a `Resync` where the learner's version is the driver's step now."""
        match decision:
            case LeaveToRay():
                return None
            case WaitForStore():
                self.check_store(step)
                return None
            case RestartRole(role="backup"):
                self.sup.count("backup", 0, decision.cause)
                self.roles.restart_backup()
                return None
            case RestartRole(role="sampler"):
                self.sup.count("sampler", decision.index, decision.cause)
                self.roles.replace_sampler(self.roles.actor_in_slot(decision.index))  # its state: untrusted
                return None
            case RestartRole(role="retrieval"):
                self.sup.count("retrieval", 0, decision.cause)
                self.roles.restart_retrieval()
                return Resync(step, replace_samplers=True)  # the new service has a new URL
            case DropSampler():
                log.warning("sampler %d is past sampler.max_restarts: %s", decision.index, decision.cause)
                self.roles.remove_sampler(self.roles.actor_in_slot(decision.index))
                return None
            case ReconcileLearner():
                return self._reconcile(step, decision.cause)
            case RestartLearner():
                return self._restart_learner(step, decision)
            case Stop():
                raise decision.error()
            case StopOnConfig():
                raise SamplerConfigFailure(decision.message, decision.key, decision.log_path)
        raise TypeError(f"no way to apply {decision!r}")

    # ---- the store ------------------------------------------------------------------------------------
    def _wait_store(self) -> int:
        """The store's pid once it answers; a store Ray will not bring back is a Stop decision."""
        try:
            pid, seen = store_pid(self.roles.store)
        except StoreGone as e:
            failure = Failure("store", "unavailable", self.sup.last_store_error or str(e))
            self.apply(self.sup.decide(failure), self.step())
            raise  # the decision above raises; this only satisfies the type checker
        self.sup.last_store_error = self.sup.last_store_error or seen
        return pid

    def _store_lost(self, error: BaseException) -> None:
        """The store client's `on_lost`: the decision for a lost store (wait for it) applied."""
        self.apply(self.sup.decide(self.sup.store_failure(error)), self.step())

    def check_store(self, step: int) -> None:
        """Waits until the store answers; a new pid means Ray restarted it: counted, and the learner's version
        told again (a reopened store starts at version 0, which would shut admission)."""
        pid = self._wait_store()
        if pid == self.store_pid:
            return
        self.store_pid = pid
        store_id = ray.get(self.roles.store.actor_id.remote())
        n = max(1, (gcs_restarts(store_id) or 0) - self.sup.restarts["store"])  # killed while restarting
        self.sup.count_ray_restarts("store", self.sup.last_store_error or "its process exited", n)
        self.sup.last_store_error = ""
        ray.get(self.roles.store.set_learner_version.remote(step))

    # ---- the learner ----------------------------------------------------------------------------------
    def _reconcile(self, step: int, cause: str) -> Resync | None:
        """Keeps the live learner: the store goes back to the learner's version (watermark = version: one
        batch per step); when the learner does not answer or the store is behind it, decides again."""
        self.sup.last_store_error = cause
        self.check_store(step)
        try:
            version = int(ray.get(self.roles.learner.progress.remote(), timeout=LEARNER_PING_S)["version"])
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.info("the kept learner does not answer: %s", brief(e))
            return self.apply(self.sup.decide(Failure("learner", "unreconciled", cause)), step)
        watermark = int(ray.get(self.roles.store.watermark.remote()))
        if watermark < version:
            failure = Failure("learner", "unreconciled", cause)
            return self.apply(self.sup.decide(failure), step)
        if watermark > version:
            ray.get(self.roles.store.rewind_to.remote(version))
        self.sup.step_retries += 1
        return self._resync(step, version)

    def _restart_learner(self, step: int, decision: RestartLearner) -> Resync | None:
        """Stops every rank, starts the learner again from its newest checkpoint (store rewound to its
        watermark; to 0 when there is none); a start that fails is a failure decided again."""
        self.sup.count("learner", 0, decision.cause)
        time.sleep(decision.backoff_s)
        self.roles.stop_learners()
        self.check_store(step)
        try:
            moved = self.roles.restart_learners()
            version = int(ray.get(self.roles.learner.progress.remote())["version"])
        except (ray.exceptions.RayError, LearnerRankError) as e:
            failure = Failure("learner", "start-failed", f"restart failed: {brief(e)}")
            return self.apply(self.sup.decide(failure), step)
        if version == 0:  # no checkpoint: the new learner holds none of the batches handed out
            ray.get(self.roles.store.rewind_to.remote(0))
        resync = self._resync(step, version)
        return Resync(resync.version, resync.step_metrics, replace_samplers=moved)

    def final_checkpoint_failed(self) -> RoleFailed:
        """The stop decision when the final checkpoint failed every time."""
        used, limit = self.sup.budgets.used("learner"), self.cfg.run.max_learner_restarts
        return Stop("learner", used, limit, "the final checkpoint failed every time").error()

    def _last_step_metrics(self, version: int) -> dict[str, float] | None:
        """The learner's own record of step `version` (None when it has none, or does not answer)."""
        try:
            last = ray.get(self.roles.learner.last_step_metrics.remote(), timeout=LEARNER_PING_S)
        except (ray.exceptions.RayError, TimeoutError):
            return None
        return last if last is not None and int(last["learner/version"]) == version else None

    def _resync(self, step: int, version: int) -> Resync:
        """The store and the batch events agree on the learner's `version` again; the driver's step follows
        through the returned record."""
        last: Any = None
        if version > step:  # trained, but the call carrying the metrics failed
            last = self._last_step_metrics(version)
            kept = None if last is None else int(last["learner/batch_index"])
            self.sup.events += catch_up_events(step, version, kept)
        elif version < step:  # restarted from an older checkpoint: later batches are trained again
            self.sup.events.append(("rewind", version))
        ray.get(self.roles.store.set_learner_version.remote(version))
        return Resync(version, last)  # the learner kept the newest step's metrics: logged after all
