"""The Ray topology: store actor, N sampler actors (FaultTolerantActorManager), backup actor, learner actor.

    samplers ──put_raw──▶ store ◀──lease_raw/put_credited── backup
        ▲                   │ take_batch (fixed B trees, exactly once)
        └── ZeroMQ weights ◀┴── learner ── checkpoint (weights, optimizer, RNG, store watermark)

The driver schedules the roles (runtime/roles.py:Roles starts and stops them) and moves metrics to
tensorboard; data goes actor to actor (trees as Arrow IPC bytes, weights over ZeroMQ). Every failed call goes
to one entry, `Driver.failed(role, error)`: runtime/fault_tolerance.py decides and acts, and the driver's step
follows the learner's version it hands back. Asynchronous by default: samplers run ahead of the learner by
at most η versions (store admission); `run.mode = sync` (η = 0) waits for the newest weights before a batch.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import ray
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from configs.schema import Config
from runtime.external_tally import ExternalTally
from runtime.fault_tolerance import FaultTolerance, Observed, Resync
from runtime.learner_group import LearnerRankError
from runtime.progress import Progress, store_metrics
from runtime.roles import Roles
from runtime.signals import Abort, GracefulStop
from runtime.topology import init_ray, role_options  # noqa: F401  (re-exported for the run's callers)
from storage.durable import write_atomic
from storage.run_control import read_control
from system.interfaces import MetricsSink
from system.roles import BackupRole, LearnerRole, SamplerRole, StoreRole

start_topology, stop_topology = Roles.start, Roles.stop  # the names the run's callers and tests know
log = logging.getLogger(__name__)
DRAIN_S = 60.0  # at the end of a harness run: the sampler calls in flight may finish (their counters counted)


class Driver:
    """Schedules the roles until the learner has done `steps` steps (or the time limit passes)."""

    def __init__(
        self,
        cfg: Config,
        topo: Roles,
        sink: MetricsSink,
        progress: Any = None,
        stop: GracefulStop | None = None,
        ft: FaultTolerance | None = None,
    ) -> None:
        self.cfg, self.topo, self.sink = cfg, topo, sink
        self.ft = ft or FaultTolerance(cfg, topo)  # the run's failure state, and the one way to act on it
        self.metrics = MetricsLogger()
        self.step = int(ray.get(topo.learner.call(LearnerRole.progress))["version"])  # one step, one version
        self.target = self.step
        self.ft.check_store(self.step)  # the store's pid: a later new one is a restart
        self.sampler_metrics: dict[int, dict[str, float]] = {}  # latest snapshot per sampler
        self.external = ExternalTally() if cfg.env.harness else None  # external/* over the run (env.harness)
        self.progress = Progress(cfg, progress, self.external)  # the bar, or a step line
        self.control_seq = (read_control(cfg.run.run_dir) or {}).get("seq", 0)
        self.last_flush = time.perf_counter()
        self.stop = stop  # runtime/signals.py: set once SIGINT/SIGTERM asked for a stop
        self.learner_call: list[Any] | None = None  # the train_step in flight on every learner rank
        self.backup_call: Any = None  # the backup's run_once in flight

    def run(self, steps: int) -> dict[str, Any]:
        """The tick loop: samplers, backup and learner each kept busy with one call, until the learner has
        reached `steps` (or the time limit passes, or a signal asked for a stop)."""
        t0, started_at, self.target = time.perf_counter(), self.step, steps
        limit = self.cfg.run.time_limit_s
        while self.step < steps and not (limit and time.perf_counter() - t0 > limit):
            if self.stop is not None and self.stop.requested():
                break
            self.ft.check_samplers(self.step)
            self._check_control()
            self._tick_samplers()
            self._tick_backup()
            if self._learner_idle() and self.step < self.target:  # one train_step on every learner rank
                self.learner_call = self.topo.learners.call(LearnerRole.train_step, 0.05)
            if time.perf_counter() - self.last_flush > 2.0:
                self.flush()
        self.flush()
        summary = {"steps": self.step, "steps_this_run": self.step - started_at}
        return {**summary, "elapsed_s": time.perf_counter() - t0, **self.ft.summary()}

    def failed(self, role: str, error: BaseException, actor_id: int | None = None) -> None:
        """The one entry for a failed call of any role: the fault tolerance decides and acts (it raises when
        the run stops); the driver's step follows the learner's version it hands back."""
        resync = self.ft.failed(role, error, self.step, actor_id)
        if resync is not None:
            self._follow(resync)

    def _follow(self, resync: Resync) -> None:
        """The learner's version is the step from now on (a step trained but never logged is logged from the
        learner's own record)."""
        if resync.step_metrics is not None:
            self.sink.log(resync.step_metrics, resync.version)
        self.step = resync.version
        self.progress.moved_to(resync.version)

    def _check_control(self) -> None:
        control = read_control(self.cfg.run.run_dir)
        if control and control.get("seq", 0) > self.control_seq:
            self.control_seq = control["seq"]
            n = int(control["samplers"])
            log.info("scaling samplers to %d", n)
            self.topo.scale_samplers(n)

    def _tick_samplers(self) -> None:
        """One `sample_and_commit` in flight per active sampler."""
        sync = self.cfg.admission_eta == 0
        kwargs: dict[str, Any] = {
            "n": self.cfg.sampler.prompts_per_request,
            "min_version": self.step if sync else 0,
        }
        kwargs["wait_s"] = self.cfg.weights.sync_wait_s  # sync mode: the wait for `min_version`
        self.topo.sample(SamplerRole.sample_and_commit, kwargs)
        self._collect_samplers()

    def finish_retiring(self, timeout_s: float = 300.0) -> bool:
        """Waits up to `timeout_s` for retiring samplers' last calls (their trees are committed) and removes
        them; starts no new calls. True when none is left retiring."""
        deadline = time.perf_counter() + timeout_s
        while self.topo.retiring and time.perf_counter() < deadline:
            self._collect_samplers()
        return not self.topo.retiring

    def _collect_samplers(self) -> None:
        for result in self.topo.sampler_results(timeout_s=0.05):
            out = result.get()
            if not result.ok:
                self.failed("sampler", out, result.actor_id)
            else:
                self.sampler_metrics[result.actor_id] = out["metrics"]
                if self.external is not None:
                    self.external.update(result.actor_id, out.get("incarnation"), out["metrics"])
            if result.actor_id not in self.topo.slots:  # replaced or removed
                self._forget(result.actor_id)
        for actor_id in self.topo.retire_idle():
            self._forget(actor_id)

    def _forget(self, actor_id: int) -> None:
        """A sampler gone from the run: its counts stay in the run's totals."""
        self.sampler_metrics.pop(actor_id, None)
        if self.external is not None:
            self.external.retire(actor_id)

    def _tick_backup(self) -> None:
        ref = self.backup_call
        if ref is None or ray.wait([ref], timeout=0)[0]:
            if ref is not None:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:  # the backup, or the store under it, was lost
                    self.failed("backup", e)
            self.backup_call = self.topo.backup.call(BackupRole.run_once, 64, 0.2)

    def _learner_idle(self) -> bool:
        """True when no learner step is in flight: the last one's metrics logged, or its failure handled."""
        if self.learner_call is None:
            return True
        try:
            done, out = self.topo.learners.poll(self.learner_call, timeout_s=0.05)  # a failed rank raises
            if done:
                self.learner_call = None
                self._trained(out)  # asks the learner for its lags: it may be lost right now too
        except (ray.exceptions.RayError, LearnerRankError) as e:  # re-synced or restarted from a checkpoint
            self.learner_call = None
            self.failed("learner", e)
            return True
        return bool(done)

    def _trained(self, out: dict[str, Any] | None) -> None:
        """A finished learner step: its metrics logged, the progress bar or step line moved."""
        if out is None:
            return
        self.step = int(out["learner/version"])
        self.sink.log(out, self.step)
        self.ft.trained(out)
        self.sink.histogram(
            "store/version_lag", ray.get(self.topo.learner.call(LearnerRole.pop_lags)), self.step
        )
        self.progress.trained(out, self.step)

    def finish_step(self, finish_s: float = 600.0) -> bool:
        """Lets the learner step in flight end (its metrics logged) without starting another; True when it
        did within `finish_s` (else it is abandoned: the final checkpoint holds the steps before it)."""
        self.target, deadline = self.step, time.monotonic() + finish_s
        while not self._learner_idle():
            if time.monotonic() > deadline:
                return False
        return True

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """After `run`: the step in flight ended when a signal stopped the run (else `Abort`, which
        runtime/ray_run.py hands to the fault tolerance), the final checkpoint, the store's counts; the
        summary, also written to RUN_DIR/summary.json."""
        signum = None if self.stop is None else self.stop.signum
        if signum is not None and not self.finish_step():
            raise Abort(signum)  # the step did not end: abandoned, the newest checkpoint stands
        summary["steps_this_run"] += self.step - summary["steps"]
        summary.update(steps=self.step, stopped_by=None if self.stop is None else self.stop.name() or None)
        summary["checkpoint"] = self.save_final()  # every rank's shards
        if self.external is not None:  # the calls in flight finish first: their trees and counters both count
            drained = self.drain_samplers(DRAIN_S)  # complete: no sampling call of the run left uncounted
            summary["external"] = {**self.external.summary(), "complete": drained}
        summary["store"] = self.ft.store.call(StoreRole.stats)
        cfg, run_dir = self.cfg, Path(self.cfg.run.run_dir)
        tb = str(run_dir / "tb") if cfg.logging.tensorboard else None
        summary.update(
            {"name": cfg.run.name, "run_dir": str(run_dir), "tensorboard": tb, "mode": cfg.run.mode}
        )
        write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2, default=str).encode())
        return summary

    def drain_samplers(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the sampler calls in flight (their trees committed, their metrics
        collected), starting none; True when none is left."""
        deadline = time.perf_counter() + timeout_s
        while self.topo.samplers_busy() > 0 and time.perf_counter() < deadline:
            self._collect_samplers()
        return self.topo.samplers_busy() == 0

    def save_final(self, tries: int = 3) -> str:
        """The final checkpoint (every rank's shards), through a store or learner lost at the last moment."""
        for _ in range(tries):
            self.ft.check_store(self.step)
            group = self.topo.learners
            try:
                return str(group.wait(group.call(LearnerRole.save_final)))
            except (ray.exceptions.RayError, LearnerRankError) as e:
                self.failed("learner", e)  # restarted or re-synced, then asked again
        self.failed("learner", Observed("final-checkpoint", "the final checkpoint failed every time"))
        raise AssertionError("unreachable: a failed final checkpoint stops the run")

    def flush(self) -> None:
        """Role metrics → MetricsLogger (sum of counters / mean of rates across samplers) → tensorboard."""
        healthy = self.topo.healthy_samplers()
        snapshots = [m for i, m in self.sampler_metrics.items() if i in healthy]
        for snapshot in snapshots:
            for key, value in snapshot.items():
                reduce = "mean" if key.endswith(("_per_s", "version", "ratio")) else "sum"
                self.metrics.log_value(key, value, reduce=reduce, window=max(len(snapshots), 1))
        backup = self._backup_metrics()  # short wait at most: run_once is quick
        self.ft.check_store(self.step)  # a store restarted by Ray: counted, told the learner version
        self.ft.check_retrieval(self.step)
        store = self.ft.store.call(StoreRole.stats)
        values = {k: float(s.peek()) for k, s in self.metrics.reduce().items()}
        values.update(backup)
        values.update(store_metrics(store))
        values["sampler/healthy"] = float(len(healthy))
        values["sampler/restarts"] = float(self.topo.samplers_restarted())
        values.update(self.ft.metrics())
        self.sink.log({k: v for k, v in values.items() if v == v}, self.step)
        self.sink.flush()
        self.last_flush = time.perf_counter()

    def _backup_metrics(self) -> dict[str, float]:
        """The backup's counters, or none while it is down (its next tick finds out why)."""
        try:
            return dict(ray.get(self.topo.backup.call(BackupRole.get_metrics), timeout=30))
        except (ray.exceptions.RayError, TimeoutError):
            return {}
