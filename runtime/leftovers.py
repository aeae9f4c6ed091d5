"""What a SIGKILLed driver leaves behind, found and stopped by the next run in the same run directory.

    reap_dead_run(run_dir)     # before init_ray: the processes a dead driver's local Ray left, killed
    init_ray(cfg)
    record_local_ray(run_dir)  # after it: this driver and every process of its local Ray instance

A local Ray instance lives in processes the driver started. A SIGKILL of the driver takes its raylet, GCS
and actors with it, but Ray's agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) are reparented to init
and stay. So each run writes RUN_DIR/ray-local.json: the driver's pid and every descendant's pid with its
start time (field 22 of /proc/PID/stat, in clock ticks since boot). The next run kills exactly those that
are still there with the same start time — a pid reused by an unrelated process has another start time —
and only when the recorded driver is gone, so a live run is never touched. Nothing else needs breaking: the
store's LOCK is an flock, released by the kernel when its holder dies. Not for a cluster (RAY_ADDRESS):
there the processes belong to `ray start`, not to the driver.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

from storage.durable import write_atomic

log = logging.getLogger(__name__)
RECORD = "ray-local.json"


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])  # fields 4 and 22 of proc(5), counted after the ")"


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live process below `root`."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            table[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out[pid] = table[pid][1]
        todo += children.get(pid, [])
    return out


def record_local_ray(run_dir: str | os.PathLike[str]) -> None:
    """Writes RUN_DIR/ray-local.json for a local Ray instance (nothing when joining a cluster)."""
    if os.environ.get("RAY_ADDRESS"):
        return
    me = os.getpid()
    st = _stat(me)
    body = {"driver": [me, st[1] if st else 0], "processes": sorted(descendants(me).items())}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(run_dir) / RECORD, json.dumps(body).encode())


def driver_alive(run_dir: str | os.PathLike[str]) -> bool | None:
    """Whether the driver that recorded RUN_DIR/ray-local.json still runs (the same pid with the same start
    time); None when there is no record (a run on a cluster, or one that never started)."""
    try:
        pid, started = json.loads((Path(run_dir) / RECORD).read_text())["driver"]
    except (OSError, ValueError, KeyError):
        return None
    st = _stat(int(pid))
    return st is not None and st[1] == started


def reap_dead_run(run_dir: str | os.PathLike[str]) -> list[int]:
    """Kills what a dead driver of this run directory left running; returns the pids killed."""
    path = Path(run_dir) / RECORD
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if driver_alive(run_dir):  # that driver is alive: not ours to touch
        return []
    killed = []
    for child, start in body["processes"]:
        now = _stat(int(child))
        if now is not None and now[1] == start:
            try:
                os.kill(int(child), signal.SIGKILL)
                killed.append(int(child))
            except ProcessLookupError:
                pass
    if killed:
        log.warning("killed %d processes left by a dead run in %s: %s", len(killed), run_dir, killed)
    path.unlink(missing_ok=True)
    return killed
