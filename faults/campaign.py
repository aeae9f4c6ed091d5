"""A fault campaign: a training run as a child process (`treeopsd train`), its roles SIGKILLed on a schedule,
then audited from its own files (faults/audit.py). `treeopsd soak` and `treeopsd drill` (launch/) are this,
each with its own schedule:

    EverySeconds(every_s=30, minutes=30, roles=ROLES, seed=0)   # soak: a random role every 30 s, then stop
    AtSteps(kill_plan(steps=300, roles=ROLES, seed=0), seed=0)  # drill: each role once, at planned steps
    got = run_campaign(train_command(run_dir, steps, config, overrides), run_dir, schedule, timeout_s)
    audit_run(run_dir, steps, got.returncode, plan, got.kills)  # then the report

The schedule's clock starts when the store hands out its first batch (the roles are up and training), so
startup time is not part of a soak's minutes. A schedule with `stop_at_s` ends the run with SIGTERM — the
run's own Ctrl-C path: the learner's step in flight ends, a final checkpoint, exit 0; one without it waits for
the run to end by itself. Past `timeout_s` the run gets SIGTERM, then SIGKILL after STOP_GRACE_S. The child
is watched by polling its files and /proc: it is another process tree, with no event to wait on.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from faults.audit import batches_handed_out
from faults.processes import MemoryWatch, kill_role

ROOT = Path(__file__).resolve().parents[1]  # the child runs `python -m launch.cli` from here
POLL_S = 0.2
STOP_GRACE_S = 120.0  # after a SIGTERM past the deadline: the step in flight and the checkpoint
STDERR_TAIL_LINES = 40  # the child's last stderr lines a campaign keeps (a stop's one line is among them)
Killer = Callable[[str, random.Random, int], int | None]  # (role, rng, child pid) -> the pid killed


class Schedule(Protocol):
    stop_at_s: float | None  # seconds of the run after which it is stopped (SIGTERM); None: it ends itself
    unit: str  # how a kill's place is logged: "step {}" or "{} s"
    rng: random.Random  # picks the victim among a role's processes too

    def due(self, t: float, handed_out: Callable[[], int]) -> tuple[Any, list[str]] | None:
        """At `t` s of the run: (where the kill is logged, the roles to try in order) when one is due."""
        ...

    def attempted(self, killed: bool) -> None:
        """The due kill was tried: a process of one of its roles was SIGKILLed, or none had one."""
        ...


def refused(name: str, run_dir: str, config: str | None, overrides: Sequence[str]) -> str | None:
    """Why `treeopsd NAME` cannot start its campaign (one line), or None: checked before any child starts."""
    from configs.schema import ConfigError, load_config

    if os.environ.get("RAY_ADDRESS"):
        return f"treeopsd {name}: runs on local Ray only (it kills processes by pid); unset RAY_ADDRESS"
    if (Path(run_dir) / "config.yaml").exists():
        return f"treeopsd {name}: {run_dir} already holds a run; pass a new --run-dir"
    try:
        load_config(config, list(overrides))
    except ConfigError as e:
        return f"treeopsd {name}: {e}"
    return None


def train_command(run_dir: Path, steps: int, config: str | None, overrides: Sequence[str]) -> list[str]:
    """The campaign's child: `treeopsd train` with this interpreter, no progress bar, the run directory
    absolute (the child runs from ROOT, the audit from here)."""
    train = ["train", "--steps", str(steps), "--run-dir", str(run_dir.resolve()), "--no-progress"]
    train += ["--config", config] if config else []
    return [sys.executable, "-m", "launch.cli", *train, *overrides]


def kill_plan(steps: int, roles: Sequence[str], seed: int) -> list[tuple[int, str]]:
    """Each role once, at distinct random steps in the first half of the run (a kill at step k lands while
    batch k is trained: after k batches are handed out; the second half leaves the run time to heal, and a
    role that is down when its turn comes time to come back before the run ends), in random order; by step.
    """
    if steps < len(roles) + 1:
        raise ValueError(f"a drill of {len(roles)} kills needs at least {len(roles) + 1} steps, got {steps}")
    rng = random.Random(seed)
    last = max(len(roles), steps // 2)
    at = sorted(rng.sample(range(1, last + 1), len(roles)))
    order = rng.sample(list(roles), len(roles))
    return list(zip(at, order, strict=True))


class EverySeconds:
    """The soak's: at every multiple of `every_s` before the stop at `minutes`, one process of a random role
    (roles tried in a seeded random order: one that is down now passes its turn to the next); a tick where no
    role has a process passes. Kills are logged at the second they happened."""

    def __init__(self, every_s: float, minutes: float, roles: Sequence[str], seed: int) -> None:
        self.every_s, self.unit, self.minutes = every_s, "{} s", minutes
        self.stop_at_s: float | None = minutes * 60
        self.roles, self.rng, self.ticks = list(roles), random.Random(seed), 0

    def due(self, t: float, handed_out: Callable[[], int]) -> tuple[Any, list[str]] | None:
        tick = (self.ticks + 1) * self.every_s
        if t < tick or tick >= self.minutes * 60:  # none at the stop itself: the stop follows at once
            return None
        self.ticks = int(t // self.every_s)  # a late poll skips the ticks it missed instead of bunching them
        return round(t, 1), self.rng.sample(self.roles, len(self.roles))

    def attempted(self, killed: bool) -> None:
        pass  # due() moved the clock on: a tick with no victim passes all the same


class AtSteps:
    """The drill's: the plan's kills in order, each once `step` batches are handed out and a random 0–1 s
    more (anywhere inside the step); a role that is down (restarting) is killed once it is back. Kills are
    logged at their planned step."""

    stop_at_s: float | None = None
    unit = "step {}"

    def __init__(self, plan: Sequence[tuple[int, str]], seed: int) -> None:
        self.plan, self.rng, self.done = list(plan), random.Random(seed), 0
        self.armed_at: float | None = None

    def due(self, t: float, handed_out: Callable[[], int]) -> tuple[Any, list[str]] | None:
        if self.done == len(self.plan):
            return None
        step, role = self.plan[self.done]
        if self.armed_at is None:
            if handed_out() < step:
                return None
            self.armed_at = t + self.rng.uniform(0.0, 1.0)
        return (step, [role]) if t >= self.armed_at else None

    def attempted(self, killed: bool) -> None:
        if killed:
            self.done, self.armed_at = self.done + 1, None


@dataclass
class CampaignRun:
    returncode: int
    kills: list[tuple[Any, str, int]] = field(default_factory=list)  # (where, role, pid), in order
    memory: MemoryWatch | None = None
    wall_s: float = 0.0
    stderr_tail: list[str] = field(default_factory=list)  # the child's last lines on stderr


class _Watch:
    """One campaign's state while its child runs: polled every POLL_S by `run_campaign`."""

    def __init__(
        self, child: subprocess.Popen[bytes], run_dir: Path, schedule: Schedule, name: str, kill: Killer
    ) -> None:
        self.child, self.store_dir, self.schedule, self.name = child, run_dir / "store", schedule, name
        self.kill_one = kill
        self.t0: float | None = None  # when the first batch was handed out: the schedule's clock
        self.stopping = False
        self.next_sample = 0.0

    def handed_out(self) -> int:
        return batches_handed_out(self.store_dir)

    def poll(self, got: CampaignRun, memory_every_s: float | None) -> None:
        if self.t0 is None:
            self.t0 = time.monotonic() if self.handed_out() > 0 else None
            return
        t = time.monotonic() - self.t0
        if got.memory is not None and memory_every_s is not None and t >= self.next_sample:
            got.memory.sample(t)
            self.next_sample = t + memory_every_s
        stop_at = self.schedule.stop_at_s
        if stop_at is not None and t >= stop_at:
            if not self.stopping:  # the run's own Ctrl-C path: the step in flight, a checkpoint, exit 0
                self.child.send_signal(signal.SIGTERM)
                self.stopping = True
            return
        due = self.schedule.due(t, self.handed_out)
        if due is not None:
            kill = self.kill(*due)
            self.schedule.attempted(kill is not None)
            if kill is not None:
                got.kills.append(kill)
                at = self.schedule.unit.format(kill[0])
                print(f"{self.name}: killed the {kill[1]} (pid {kill[2]}) at {at}", flush=True)

    def kill(self, at: Any, roles: list[str]) -> tuple[Any, str, int] | None:
        """SIGKILLs one process of the first of `roles` that has one now; (at, role, pid), or None."""
        for role in roles:
            victim = self.kill_one(role, self.schedule.rng, self.child.pid)
            if victim is not None:
                return at, role, victim
        return None


def _end(child: subprocess.Popen[bytes], deadline: float) -> int:
    """The child's exit status: waited for until `deadline`, then SIGTERM, then SIGKILL after STOP_GRACE_S."""
    try:
        return child.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        child.terminate()
    try:
        return child.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def _tee_stderr(child: subprocess.Popen[bytes], tail: list[str]) -> threading.Thread:
    """Copies the child's stderr to ours as it comes, keeping its last STDERR_TAIL_LINES lines in `tail`."""

    def pump() -> None:
        assert child.stderr is not None
        for raw in child.stderr:
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
            tail.append(raw.decode(errors="replace").rstrip("\n"))
            del tail[:-STDERR_TAIL_LINES]

    thread = threading.Thread(target=pump, name="campaign-stderr", daemon=True)
    thread.start()
    return thread


def run_campaign(
    cmd: list[str],
    run_dir: Path,
    schedule: Schedule,
    timeout_s: float,
    memory_every_s: float | None = None,
    name: str = "campaign",
    ray_address: str | None = None,
    kill: Killer = kill_role,
    on_poll: Callable[[], None] | None = None,
) -> CampaignRun:
    """Runs `cmd` (a training run writing `run_dir`) as a child, kills per `schedule` (one process of a role
    by pid with the default `kill`), samples memory every `memory_every_s`, and waits for it to end; its exit
    status, the kills done, the memory watch, the wall time, its last stderr lines. Without `ray_address` the
    child runs on a local Ray of its own (RAY_ADDRESS dropped: kills by pid stay inside its own instance);
    with it, the child joins that cluster (the node drill's, faults/nodes.py). `on_poll` runs at every poll
    (the node drill adds replacement nodes there)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_ADDRESS": ray_address} if ray_address else {}
    t_start = time.monotonic()
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE)
    got = CampaignRun(0, memory=None if memory_every_s is None else MemoryWatch(child.pid))
    tee = _tee_stderr(child, got.stderr_tail)
    watch, deadline = _Watch(child, run_dir, schedule, name, kill), t_start + timeout_s
    try:
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            watch.poll(got, memory_every_s)
            if on_poll is not None:
                on_poll()
        got.returncode = _end(child, deadline)
    finally:
        if child.poll() is None:  # interrupted here: the run is not left behind
            child.kill()
    tee.join(timeout=10)
    got.wall_s = round(time.monotonic() - t_start, 1)
    return got


def write_report(report: dict[str, Any], name: str, run_dir: Path, results: str | None) -> str:
    """The report as JSON, written to RUN_DIR/NAME and, with `results`, copied to RESULTS/NAME (`make readme`
    renders docs/results.md's block from it: tools/fault_report.py); the text."""
    from storage.durable import write_atomic

    text = json.dumps(report, indent=2, default=str)
    write_atomic(run_dir / name, text.encode())
    if results:
        Path(results).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(results) / name, text.encode())
    return text
