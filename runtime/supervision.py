"""Self-healing roles on Ray (docs/design.md, "Supervision"): the driver's `Supervisor` restarts what died
and returns what the driver must do about it; it never writes the driver's state.

    sup = Supervisor(cfg, topo)                  # the driver holds one (runtime.driver.Driver)
    sup.backup_failed(step, err)                 # a new backup actor; its leased trees come back on their own
    sup.check_store(step)                        # a store restarted by Ray (new pid): counted, told the step
    decision = sup.learner_failed(step, err)     # keep and re-sync a live learner, or restart it: a `Resync`
    driver.apply(decision)                       # the driver's step, progress and samplers follow it
    sup.metrics()                                # supervision/restarts_<role>, for tensorboard

Who restarts what:
  * samplers: Ray (`sampler.max_restarts`) under RLlib's FaultTolerantActorManager, as before;
  * the store: Ray (`run.max_store_restarts`): the constructor reopens the directory (torn files quarantined,
    leases and admission reservations, which live in memory, handed back), every client keeps its handle;
    a call in flight at the death fails, and each caller's failure path below handles it;
  * the backup: the supervisor starts a new actor (`run.max_backup_restarts`); it is stateless;
  * the learner: the supervisor (`run.max_learner_restarts`). A single learner whose step raised only because
    the store was lost under it is kept: its model is whole, so the store is rewound to the learner's own
    version (batches handed out but never trained come back) and the step is tried again. Anything else
    stops the learner (every rank), starts it again with resume=True — newest valid checkpoint, store rewound
    to its watermark — on the same weight port, so the samplers' subscribers follow the new publisher (they
    accept a restarted publisher's older versions); if the endpoint changes anyway (the port was taken, CURVE
    keys are per publisher), the samplers are replaced by ones that subscribe to the new endpoint.

Every restart is a log line naming the role and the cause, and a metric; a role past its budget raises
`RoleFailed` (the message names the role and its last error; `treeopsd train` adds the resume command).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import ray

from configs.schema import Config
from runtime.learner_group import LearnerGroup, LearnerRankError
from runtime.restart_policy import (
    RestartBudget,
    RoleFailed,
    backoff_s,
    catch_up_events,
    failure_kind,
    learner_action,
)
from runtime.topology import role_options, start_backup

log = logging.getLogger("treeopsd.supervision")


@dataclass(frozen=True)
class Resync:
    """The supervisor's decision after a learner failure, for the driver to apply (`Driver.apply`)."""

    version: int  # the learner's version: the driver's step from now on
    step_metrics: dict[str, float] | None = None  # step `version` trained but its call failed: log these
    replace_samplers: bool = False  # the weight endpoint moved: retire the active samplers, start as many


STORE_WAIT_S = 600.0  # a restarted store reopens its directory first: that scans every segment
LEARNER_PING_S = 60.0


def brief(e: BaseException) -> str:
    """One line for a failure: the exception type and its message, Ray's death notice cut to its exit type."""
    cause = getattr(e, "cause", None) or e
    text = " ".join(str(cause).split())
    kind = re.search(r"Worker exit type: (\w+)", text)
    if kind and not isinstance(e, ray.exceptions.RayTaskError):
        text = f"its worker process exited ({kind.group(1)})"
    return f"{type(cause).__name__}: {text}"[:300]


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
    """Ray's count (GCS) over the samplers the topology manages now, or the manager's when Ray does not say;
    the manager sees only the restarts of samplers it had marked unhealthy (one killed between two calls is
    not)."""
    ids = [r.get() for r in topo.manager.foreach_actor("actor_id", timeout_seconds=30) if r.ok]
    counts = [gcs_restarts(i) for i in ids]
    seen = topo.manager.total_num_restarts()
    return int(seen if None in counts else max(seen, sum(c for c in counts if c is not None)))


def kind_of(e: BaseException) -> str:
    """failure_kind of a Ray error: a task error (the actor's code raised) whose cause is a lost actor is
    "store" (the only actor the roles call); a RayActorError otherwise means the actor itself died."""
    if isinstance(e, LearnerRankError):
        return "died" if " died " in str(e) else "raised"
    task = isinstance(e, ray.exceptions.RayTaskError)
    cause = getattr(e, "cause", None)
    return failure_kind(task, isinstance(cause, ray.exceptions.RayActorError))


class Supervisor:
    """Restart budgets, counts and the batch events of one driver (runtime/restart_policy.py)."""

    def __init__(self, cfg: Config, topo: Any) -> None:
        self.cfg, self.topo = cfg, topo
        r = cfg.run
        limits = {
            "learner": r.max_learner_restarts,
            "store": r.max_store_restarts,
            "backup": r.max_backup_restarts,
        }
        self.budgets = {role: RestartBudget(role, n) for role, n in limits.items()}
        self.restarts: Counter[str] = Counter()
        self.step_retries = 0  # learner steps tried again after the store was lost under them
        self.events: list[tuple[str, int]] = []  # restart_policy.batch_audit reads these
        self.store_pid = self._store_pid()
        self.last_store_error = ""

    # ---- reporting ------------------------------------------------------------------------------------
    def _restarted(self, role: str, cause: str, n: int = 1) -> None:
        self.restarts[role] += n
        limit = self.budgets[role].limit if role in self.budgets else "?"
        log.warning("restarting the %s (%d of %s): %s", role, self.restarts[role], limit, cause)

    def metrics(self) -> dict[str, float]:
        out = {f"supervision/restarts_{role}": float(self.restarts[role]) for role in self.budgets}
        out["supervision/learner_step_retries"] = float(self.step_retries)
        return out

    def summary(self) -> dict[str, Any]:
        return {"restarts": dict(self.restarts), "learner_step_retries": self.step_retries}

    def trained(self, out: dict[str, Any]) -> None:
        """A learner step's metrics arrived: batch `learner/batch_index` is trained."""
        self.events.append(("trained", int(out["learner/batch_index"])))

    # ---- the store ------------------------------------------------------------------------------------
    def _store_pid(self, timeout_s: float = STORE_WAIT_S) -> int:
        """The store's pid once it answers; a store being restarted answers "unavailable" meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                return int(ray.get(self.topo.store.pid.remote(), timeout=max(left, 0.1)))
            except ray.exceptions.ActorUnavailableError as e:  # restarting: ask again
                self.last_store_error = self.last_store_error or brief(e)
                last = f"unavailable for {timeout_s:.0f} s"
                if left > 0:
                    time.sleep(0.5)
                    continue
            except ray.exceptions.GetTimeoutError:
                last = f"no answer within {timeout_s:.0f} s"
            except ray.exceptions.RayActorError as e:  # dead for good: Ray's restarts are used up
                last = self.last_store_error or brief(e)
            raise RoleFailed("store", self.restarts["store"], self.cfg.run.max_store_restarts, last)

    def check_store(self, step: int) -> None:
        """Waits until the store answers; a new pid means Ray restarted it: counted, and the learner's version
        told again (a reopened store starts at version 0, which would shut admission)."""
        pid = self._store_pid()
        if pid == self.store_pid:
            return
        self.store_pid = pid
        store_id = ray.get(self.topo.store.actor_id.remote())
        n = max(1, (gcs_restarts(store_id) or 0) - self.restarts["store"])  # killed while restarting
        self._restarted("store", self.last_store_error or "its process exited", n)
        self.last_store_error = ""
        ray.get(self.topo.store.set_learner_version.remote(step))

    def store_call(self, step: int, method: str, *args: Any) -> Any:
        """A driver's call on the store that survives one store restart (the call is repeated once)."""
        try:
            return ray.get(getattr(self.topo.store, method).remote(*args))
        except ray.exceptions.RayActorError as e:
            self.last_store_error = brief(e)
            self.check_store(step)
            return ray.get(getattr(self.topo.store, method).remote(*args))

    # ---- the backup -----------------------------------------------------------------------------------
    def backup_failed(self, step: int, error: BaseException) -> None:
        """A failed `run_once`: lost store → wait for it; the backup dead or raising → a new backup."""
        kind = kind_of(error)
        if kind == "store":
            self.last_store_error = brief(error)
            self.check_store(step)
            return
        cause = brief(error)
        self.budgets["backup"].record(cause)
        self._restarted("backup", cause)
        try:
            ray.kill(self.topo.backup, no_restart=True)  # a live one that raised; a dead one: nothing to do
        except ray.exceptions.RayError as e:
            log.info("killing the old backup: %s", brief(e))
        self.topo.backup = start_backup(self.cfg, self.topo.store)

    def backup_metrics(self) -> dict[str, float]:
        """The backup's counters, or none while it is down (its next tick finds out why)."""
        try:
            return dict(ray.get(self.topo.backup.get_metrics.remote(), timeout=30))
        except (ray.exceptions.RayError, TimeoutError):
            return {}

    # ---- the learner ----------------------------------------------------------------------------------
    def learner_failed(self, step: int, error: BaseException) -> Resync:
        """A failed learner call: the live learner kept and re-synced, or every rank restarted."""
        kind, cause = kind_of(error), brief(error)
        log.warning("learner step failed (%s): %s", kind, cause)
        if kind == "raised":  # its own exception: the whole remote traceback, for the bug report
            log.warning("%s", error)
        if learner_action(kind, self.cfg.learner.ranks) == "reconcile":
            self.last_store_error = cause
            version = self._reconcile(step)
            if version is not None:
                return self._resync(step, version)
        return self.restart_learner(step, cause)

    def _reconcile(self, step: int) -> int | None:
        """Keeps the live learner: the store goes back to the learner's version (watermark = version: one
        batch per step); that version, or None when the learner does not answer or the store is behind it."""
        self.check_store(step)
        try:
            version = int(ray.get(self.topo.learner.progress.remote(), timeout=LEARNER_PING_S)["version"])
        except (ray.exceptions.RayError, TimeoutError):
            return None
        watermark = int(ray.get(self.topo.store.watermark.remote()))
        if watermark < version:
            return None
        if watermark > version:
            ray.get(self.topo.store.rewind_to.remote(version))
        self.step_retries += 1
        return version

    def restart_learner(self, step: int, cause: str) -> Resync:
        """Stops every rank, starts the learner again from its newest checkpoint (store rewound to its
        watermark; to 0 when there is none), tries again within the budget while a start fails."""
        while True:
            n = self.budgets["learner"].record(cause)
            self._restarted("learner", cause)
            time.sleep(backoff_s(n))
            self._stop_learners(self.topo.learners)
            self.check_store(step)
            try:
                group, endpoint = self._start_learners()
                version = int(ray.get(group.rank0.progress.remote())["version"])
                break
            except (ray.exceptions.RayError, LearnerRankError) as e:
                cause = f"restart failed: {brief(e)}"
        if version == 0:  # no checkpoint: the new learner holds none of the batches handed out
            ray.get(self.topo.store.rewind_to.remote(0))
        self.topo.learners, self.topo.learner = group, group.rank0
        moved = self._follow_endpoint(endpoint)
        decision = self._resync(step, version)
        return Resync(decision.version, decision.step_metrics, replace_samplers=moved)

    def final_checkpoint_failed(self) -> RoleFailed:
        """The stop decision when the final checkpoint failed every time."""
        limit = self.cfg.run.max_learner_restarts
        return RoleFailed(
            "learner", self.restarts["learner"], limit, "the final checkpoint failed every time"
        )

    @staticmethod
    def _stop_learners(group: LearnerGroup | None) -> None:
        if group is None:
            return
        try:
            group.stop(timeout_s=5.0)
        except ray.exceptions.RayError as e:  # a dead rank's handle: nothing left to stop
            log.info("stopping the old learner: %s", brief(e))

    def _start_learners(self) -> tuple[LearnerGroup, tuple[str, Any]]:
        """A learner group resumed from the newest checkpoint, on the old weight port unless it is taken."""
        data, _, _, endpoint, _ = self.topo.args
        port = int(endpoint.rsplit(":", 1)[1])
        try:
            return self._start_on({**data, "weights": {**data["weights"], "port": port}})
        except (ray.exceptions.RayError, LearnerRankError) as e:
            if "Address already in use" not in str(e):
                raise  # a failed start: restart_learner counts it and tries again
            log.warning("weight port %d is taken: the learner restarts on a free one", port)
        return self._start_on(data)

    def _start_on(self, data: dict[str, Any]) -> tuple[LearnerGroup, tuple[str, Any]]:
        from runtime.learner_group import start_learner_group

        model_path = self.topo.args[1]
        group = start_learner_group(
            self.cfg, data, model_path, self.topo.store, True, role_options(self.cfg, "learner")
        )
        try:
            return group, tuple(ray.get(group.rank0.endpoint.remote()))  # type: ignore[return-value]
        except ray.exceptions.RayError:
            self._stop_learners(group)
            raise

    def _follow_endpoint(self, endpoint: tuple[str, Any]) -> bool:
        """True when the weights moved to a new endpoint: the samplers subscribed to the old one must be
        replaced by ones that subscribe to the new one (new samplers get the new endpoint from here on)."""
        data, model_path, store_name, old, old_key = self.topo.args
        if tuple(endpoint) == (old, old_key):
            return False
        log.warning("weights moved from %s to %s: replacing the samplers", old, endpoint[0])
        self.topo.args = (data, model_path, store_name, endpoint[0], endpoint[1])
        return True

    def _last_step_metrics(self, version: int) -> dict[str, float] | None:
        """The learner's own record of step `version` (None when it has none, or does not answer)."""
        try:
            last = ray.get(self.topo.learner.last_step_metrics.remote(), timeout=LEARNER_PING_S)
        except (ray.exceptions.RayError, TimeoutError):
            return None
        return last if last is not None and int(last["learner/version"]) == version else None

    def _resync(self, step: int, version: int) -> Resync:
        """The store and the batch events agree on the learner's `version` again; the driver's step follows
        through the returned decision."""
        last = None
        if version > step:  # trained, but the call carrying the metrics failed
            last = self._last_step_metrics(version)
            kept = None if last is None else int(last["learner/batch_index"])
            self.events += catch_up_events(step, version, kept)
        elif version < step:  # restarted from an older checkpoint: later batches are trained again
            self.events.append(("rewind", version))
        ray.get(self.topo.store.set_learner_version.remote(version))
        return Resync(version, last)  # the learner kept the newest step's metrics: logged after all
