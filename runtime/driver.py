"""The Ray topology: store actor, N sampler actors (FaultTolerantActorManager), backup actor, learner actor.

    samplers ──put_raw──▶ store ◀──lease_raw/put_credited── backup
        ▲                   │ take_batch (fixed B trees, exactly once)
        └── ZeroMQ weights ◀┴── learner ── checkpoint (weights, optimizer, RNG, store watermark)

The roles are started, replaced and stopped by runtime/roles.py:Roles alone; this module is the driver that
schedules them. When a role fails, runtime/supervision.py turns the error into a `Failure` and decides
(runtime/decisions.py: restart it, re-sync the learner, replace a sampler, wait for the store, or stop with
a message: `RoleFailed`); the driver applies the decision (runtime/recovery.py, then its own state).

The driver only schedules calls and moves metrics to tensorboard; data goes actor to actor (trees as Arrow
IPC bytes through the object store, weights over ZeroMQ). Asynchronous by default: samplers run ahead of
the learner by at most η versions (store admission). `run.mode = sync` (or η = 0) is the synchronous
baseline with the same components: samplers wait for the newest weights before each batch.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from actors.failures import SamplerFailure
from configs.schema import Config
from runtime.decisions import Decision, DropSampler, RestartRole
from runtime.external_tally import ExternalTally
from runtime.learner_group import LearnerRankError
from runtime.recovery import Recovery, Resync
from runtime.roles import Roles, start_topology, stop_topology  # noqa: F401  (re-exported for callers)
from runtime.signals import Abort
from runtime.supervision import Supervisor, sampler_failure, sampler_restarts
from runtime.topology import init_ray, role_options  # noqa: F401  (re-exported for the run's callers)
from storage.durable import write_atomic
from system.interfaces import MetricsSink

log = logging.getLogger(__name__)
CONTROL_FILE = "control.json"
DRAIN_S = 60.0  # at the end of a harness run: the sampler calls in flight may finish (their counters counted)


def read_control(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """`treeopsd scale` writes run_dir/control.json atomically; None when there is none."""
    path = Path(run_dir) / CONTROL_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return None


class Driver:
    """Schedules the roles until the learner has done `steps` steps (or the time limit passes)."""

    def __init__(self, cfg: Config, topo: Roles, sink: MetricsSink, progress=None, stop=None) -> None:
        self.cfg, self.topo, self.sink, self.progress = cfg, topo, sink, progress
        self.metrics = MetricsLogger()
        self.step = int(ray.get(topo.learner.progress.remote())["version"])  # one step, one version
        self.target = self.step
        self.sampler_failures = 0
        self.last_failure: SamplerFailure | None = None  # root cause and log file, for the final message
        self.sampler_metrics: dict[int, dict[str, float]] = {}  # latest snapshot per sampler
        self.external = ExternalTally() if cfg.env.harness else None  # external/* over the run (env.harness)
        self.retiring: set[int] = set()
        self.last_healthy = time.perf_counter()
        self.control_seq = (read_control(cfg.run.run_dir) or {}).get("seq", 0)
        self.last_flush = time.perf_counter()
        self.supervisor = Supervisor(cfg)  # observes and decides (runtime/supervision.py)
        self.recovery = Recovery(cfg, topo, self.supervisor, lambda: self.step)  # applies, through Roles
        self.stop = stop  # runtime/signals.py: GracefulStop, set once SIGINT/SIGTERM asked for a stop
        self.stop_requested = stop.requested if stop is not None else lambda: False
        self.learner_call: list[Any] | None = None  # the train_step in flight on every learner rank
        self.backup_call: Any = None  # the backup's run_once in flight

    def run(self, steps: int) -> dict[str, Any]:
        """The tick loop: samplers, backup and learner each kept busy with one call, until the learner has
        reached `steps` (or the time limit passes, or a signal asked for a stop)."""
        t0, started_at, self.target = time.perf_counter(), self.step, steps
        limit = self.cfg.run.time_limit_s
        over = lambda: bool(limit and time.perf_counter() - t0 > limit) or self.stop_requested()  # noqa: E731
        while self.step < steps and not over():
            self._check_samplers_alive()
            self._check_control()
            self._tick_samplers()
            self._tick_backup()
            if self._learner_idle() and self.step < self.target:  # one train_step on every learner rank
                self.learner_call = self.topo.learners.call("train_step", 0.05)
            if time.perf_counter() - self.last_flush > 2.0:
                self.flush()
        self.flush()
        elapsed = time.perf_counter() - t0
        return {
            "steps": self.step,
            "steps_this_run": self.step - started_at,
            "elapsed_s": elapsed,
            "sampler_failures": self.sampler_failures,
            "sampler_restarts": sampler_restarts(self.topo),  # Ray's own count where it has one
            **self.supervisor.summary(),
        }

    def _check_samplers_alive(self) -> None:
        """Fails the run, instead of waiting forever, when no sampler has been healthy for
        `sampler.unhealthy_grace_s`, naming the last failure's root cause and log file."""
        now, grace_s = time.perf_counter(), self.cfg.sampler.unhealthy_grace_s
        if self.topo.manager.num_healthy_actors() > 0:
            self.last_healthy = now
        elif now - self.last_healthy > grace_s:
            cause = self.last_failure or f"no failure reported; see {Path(self.cfg.run.run_dir) / 'logs'}"
            raise RuntimeError(f"no healthy sampler for {grace_s:.0f} s (restarts exhausted): {cause}")

    def _check_control(self) -> None:
        control = read_control(self.cfg.run.run_dir)
        if control and control.get("seq", 0) > self.control_seq:
            self.control_seq = control["seq"]
            n = int(control["samplers"])
            log.info("scaling samplers to %d", n)
            self.retiring |= set(self.topo.scale_samplers(n, frozenset(self.retiring)))

    def _tick_samplers(self) -> None:
        """One `sample_and_commit` in flight per active sampler (tagged by actor id, so the driver can tell
        when a retiring one has none left)."""
        sync = self.cfg.admission_eta == 0
        kwargs = {"n": self.cfg.sampler.prompts_per_request, "min_version": self.step if sync else 0}
        kwargs["wait_s"] = self.cfg.weights.sync_wait_s  # sync mode: the wait for `min_version`
        manager = self.topo.manager
        for i in manager.healthy_actor_ids():
            if i not in self.retiring and manager.num_outstanding_async_reqs(_tag(i)) == 0:
                manager.foreach_actor_async("sample_and_commit", _tag(i), kwargs=kwargs, remote_actor_ids=[i])
        self._collect_samplers()

    def finish_retiring(self, timeout_s: float = 300.0) -> bool:
        """Waits up to `timeout_s` for retiring samplers' last calls (their trees are committed) and removes
        them; starts no new calls. True when none is left retiring."""
        deadline = time.perf_counter() + timeout_s
        while self.retiring and time.perf_counter() < deadline:
            self._collect_samplers()
        return not self.retiring

    def _collect_samplers(self) -> None:
        for result in self.topo.manager.fetch_ready_async_reqs(timeout_seconds=0.05):
            if not result.ok:
                self._sampler_failed(result.actor_id, result.get())
                continue
            out = result.get()
            self.sampler_metrics[result.actor_id] = out["metrics"]
            if self.external is not None:
                self.external.update(result.actor_id, out.get("incarnation"), out["metrics"])
        self.topo.manager.probe_unhealthy_actors(timeout_seconds=0.1, mark_healthy=True)
        self._retire_idle()

    def _sampler_failed(self, actor_id: int, error: BaseException) -> None:
        """A failed sampler call: its reservation goes back, and the decision is applied — Ray restarts a
        dead one, Roles replaces one that raised (drops it past its restarts), a config failure stops all."""
        self.sampler_failures += 1
        self.recovery.store.call("release", self.cfg.sampler.prompts_per_request)
        failure, explained = sampler_failure(error, self.topo.slots.get(actor_id, -1), self.cfg)
        log.warning("sampler %s failed: %s", actor_id, explained)
        self.last_failure = explained
        decision = self.supervisor.decide(failure)
        if actor_id in self.retiring and isinstance(decision, RestartRole | DropSampler):
            self.retiring.discard(actor_id)  # on its way out anyway: removed, not replaced
            self.topo.remove_sampler(actor_id)
        else:
            self._apply(decision)
        if actor_id not in self.topo.slots:  # replaced or removed: its counts stay in the run's totals
            self.sampler_metrics.pop(actor_id, None)
            if self.external is not None:
                self.external.retire(actor_id)

    def _apply(self, decision: Decision) -> None:
        """A supervisor's decision carried out (runtime/recovery.py); the driver's state follows a Resync."""
        resync = self.recovery.apply(decision, self.step)
        if resync is not None:
            self.apply(resync)

    def _retire_idle(self) -> None:
        """Removes retiring samplers once their last call has returned (its trees are committed)."""
        for actor_id in list(self.retiring):
            if self.topo.manager.num_outstanding_async_reqs(_tag(actor_id)) == 0:
                self.topo.remove_sampler(actor_id)
                self.retiring.discard(actor_id)
                self.sampler_metrics.pop(actor_id, None)
                if self.external is not None:
                    self.external.retire(actor_id)  # its counts stay in the run's totals

    def _tick_backup(self) -> None:
        ref = self.backup_call
        if ref is None or ray.wait([ref], timeout=0)[0]:
            if ref is not None:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:  # the backup, or the store under it, was lost
                    self._apply(self.supervisor.decide(self.supervisor.backup_failure(e)))
            self.backup_call = self.topo.backup.run_once.remote(64, 0.2)

    def _learner_idle(self) -> bool:
        """True when no learner step is in flight: the last one's metrics are logged, or its failure handled
        (the supervisor's decision applied)."""
        if self.learner_call is None:
            return True
        try:
            done, out = self.topo.learners.poll(self.learner_call, timeout_s=0.05)  # a failed rank raises
            if done:
                self.learner_call = None
                self._trained(out)  # asks the learner for its lags: it may be lost right now too
        except (ray.exceptions.RayError, LearnerRankError) as e:  # re-synced or restarted from a checkpoint
            self.learner_call = None
            self._apply(self.supervisor.decide(self.supervisor.learner_failure(e)))
            return True
        return done

    def _trained(self, out: dict[str, Any] | None) -> None:
        """A finished learner step: its metrics logged, the progress bar or step line moved."""
        if out is None:
            return
        self.step = int(out["learner/version"])
        self.sink.log(out, self.step)
        self.supervisor.trained(out)
        self.sink.histogram("store/version_lag", ray.get(self.topo.learner.pop_lags.remote()), self.step)
        ext = None if self.external is None else self.external.short()  # "ext 12ep 3side 0drop"
        if self.progress is not None:
            self.progress.update(1)
            postfix = {
                "reward": f"{out.get('reward/mean', 0):.3f}",
                "loss": f"{out.get('learner/loss', 0):.4f}",
            }
            self.progress.set_postfix(
                postfix if ext is None else {**postfix, "ext": ext.removeprefix("ext ")}
            )
        if getattr(self.progress, "disable", True) and self.step % self.cfg.logging.log_every == 0:
            line = step_line(out, self.step, self.cfg.run.steps, ext)  # no bar: a line every log_every steps
            print(line, file=sys.stderr, flush=True)

    def apply(self, decision: Resync) -> None:
        """A supervisor's decision after a learner failure: the learner's version is the step from now on
        (a step trained but never logged is logged from the learner's own record); samplers subscribed to
        a weight endpoint that is gone retire after their current call and as many new ones start."""
        if decision.step_metrics is not None:
            self.sink.log(decision.step_metrics, decision.version)
        self.step = decision.version
        if self.progress is not None:
            self.progress.n = decision.version
            self.progress.refresh()
        if decision.replace_samplers:
            active = [i for i in self.topo.manager.actor_ids() if i not in self.retiring]
            self.retiring |= set(active)
            self.topo.scale_samplers(len(active), frozenset(self.retiring))

    def finish_step(self, finish_s: float = 600.0) -> bool:
        """Lets the learner step in flight end (its metrics logged) without starting another; True when it
        did within `finish_s` (else it is abandoned: the final checkpoint holds the steps before it)."""
        self.target, deadline = self.step, time.monotonic() + finish_s
        while not self._learner_idle():
            if time.monotonic() > deadline:
                return False
        return True

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """After `run`: the step in flight ended when a signal stopped the run (else `Abort`), the final
        checkpoint, the store's counts; the summary, also written to RUN_DIR/summary.json."""
        signum = None if self.stop is None else self.stop.signum
        if signum is not None and not self.finish_step():
            raise Abort(signum)  # the step did not end: abandoned, the newest checkpoint stands
        summary["steps_this_run"] += self.step - summary["steps"]
        summary.update(steps=self.step, stopped_by=None if self.stop is None else self.stop.name() or None)
        summary["checkpoint"] = self.save_final()  # every rank's shards
        if self.external is not None:  # the calls in flight finish first: their trees and counters both count
            drained = self.drain_samplers(DRAIN_S)  # complete: no sampling call of the run left uncounted
            summary["external"] = {**self.external.summary(), "complete": drained}
        summary["store"] = ray.get(self.topo.store.stats.remote())
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
        deadline, manager = time.perf_counter() + timeout_s, self.topo.manager
        while manager.num_outstanding_async_reqs() > 0 and time.perf_counter() < deadline:
            self._collect_samplers()
        return manager.num_outstanding_async_reqs() == 0

    def save_final(self, tries: int = 3) -> str:
        """The final checkpoint (every rank's shards), through a store or learner lost at the last moment."""
        for _ in range(tries):
            self.recovery.check_store(self.step)
            group = self.topo.learners
            try:
                return str(group.wait(group.call("save_final")))
            except (ray.exceptions.RayError, LearnerRankError) as e:
                self._apply(self.supervisor.decide(self.supervisor.learner_failure(e)))  # then asked again
        raise self.recovery.final_checkpoint_failed()

    def flush(self) -> None:
        """Role metrics → MetricsLogger (sum of counters / mean of rates across samplers) → tensorboard."""
        healthy = self.topo.manager.healthy_actor_ids()
        snapshots = [m for i, m in self.sampler_metrics.items() if i in healthy]
        for snapshot in snapshots:
            for key, value in snapshot.items():
                reduce = "mean" if key.endswith(("_per_s", "version", "ratio")) else "sum"
                self.metrics.log_value(key, value, reduce=reduce, window=max(len(snapshots), 1))
        backup = self._backup_metrics()  # short wait at most: run_once is quick
        self.recovery.check_store(self.step)  # a store restarted by Ray: counted, told the learner version
        self._check_retrieval()
        store = self.recovery.store.call("stats")
        values = {k: float(s.peek()) for k, s in self.metrics.reduce().items()}
        values.update(backup)
        values.update(_store_metrics(store))
        values["sampler/healthy"] = float(len(healthy))
        values["sampler/restarts"] = float(self.topo.manager.total_num_restarts())
        values.update(self.supervisor.metrics())
        self.sink.log({k: v for k, v in values.items() if v == v}, self.step)
        self.sink.flush()
        self.last_flush = time.perf_counter()

    def _backup_metrics(self) -> dict[str, float]:
        """The backup's counters, or none while it is down (its next tick finds out why)."""
        try:
            return dict(ray.get(self.topo.backup.get_metrics.remote(), timeout=30))
        except (ray.exceptions.RayError, TimeoutError):
            return {}

    def _check_retrieval(self) -> None:
        """A retrieval service whose actor died is a failure decided like any other (a stopped server whose
        actor lives is not: the samplers' searches fail as tool errors)."""
        if self.topo.retrieval is None:
            return
        try:
            ray.get(self.topo.retrieval.describe.remote(), timeout=10)
        except ray.exceptions.RayActorError as e:
            self._apply(self.supervisor.decide(self.supervisor.retrieval_failure(e)))
        except ray.exceptions.GetTimeoutError:
            log.info("the retrieval service did not answer within 10 s")


def _tag(actor_id: int) -> str:
    return f"sampler-{actor_id}"


def _store_metrics(stats: dict[str, Any]) -> dict[str, float]:
    trees = stats["trees"]
    out = {f"store/trees_{k}": float(trees[k]) for k in ("raw", "credited", "consumed", "total")}
    out["store/trees_pending"] = float(trees["raw"] + trees["credited"])
    out["store/quarantined"] = float(stats["quarantined"])
    out["store/reserved"] = float(stats["admission"]["reserved"])
    return out


def step_line(metrics: dict[str, float], step: int, target: int, ext: str | None = None) -> str:
    """The line a run without a progress bar prints every `logging.log_every` steps (`ext`: the external
    agent's counters, runtime/external_tally.py, with env.harness)."""
    reward, loss = metrics.get("reward/mean", float("nan")), metrics.get("learner/loss", float("nan"))
    step_s = metrics.get("learner/step_s", float("nan"))
    line = f"step {step}/{target}: reward {reward:.3f}, loss {loss:.4f}, learner {step_s:.2f} s/step"
    return line if ext is None else f"{line}, {ext}"
