"""The processes of a training run, found through /proc: each role's actor processes, a SIGKILL to one of
them, and their resident memory over time (faults/campaign.py drives them; tests/ray/test_supervision.py
kills roles of an in-process topology with `kill_role`).

    role_processes(root_pid)                    # {"sampler": [pid, ...], "backup": [...], ...}
    kill_role("store", rng, root_pid)           # the pid SIGKILLed, or None when the role has none now
    memory = MemoryWatch(root_pid); memory.sample(t)   # every process's RSS at t seconds; .report(...)

No Ray call: a call to a busy actor waits behind its current one, so asking an actor for its pid would only
ever kill it between calls. Ray titles a role's actor process `ray::<ActorClass>` (or
`ray::<ActorClass>.<method>` while it runs one), and only descendants of `root_pid` count — the raylet the
run's driver started is their parent — so nothing of another Ray instance on the machine is ever touched.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROLE_CLASSES = {
    "sampler": ("SamplerActor",),
    "backup": ("BackupActor",),
    "store": ("StoreActor",),
    "learner": ("LearnerActor", "LearnerRankActor"),
}
ROLES = tuple(ROLE_CLASSES)


def _proc_table() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, title)} of every process that can be read now."""
    out: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            title = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        out[int(name)] = (int(stat.rsplit(")", 1)[1].split()[1]), title)
    return out


def role_processes(root_pid: int | None = None) -> dict[str, list[int]]:
    """{role: [pid, ...]} of the role actors descending from `root_pid` (default: this process)."""
    root, table = root_pid or os.getpid(), _proc_table()

    def descends(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            if pid == root:
                return True
            pid, seen = table.get(pid, (1, ""))[0], seen + 1
        return False

    out: dict[str, list[int]] = {role: [] for role in ROLE_CLASSES}
    for pid, (_, title) in table.items():
        if not title.startswith("ray::"):
            continue
        cls = title[5:].split(".", 1)[0]
        for role, names in ROLE_CLASSES.items():
            if cls in names and descends(pid):
                out[role].append(pid)
    return out


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and every live process descending from it (a fake node's raylet: the node's agents and
    workers), parents before children; zombies (dead, not yet reaped) are left out."""
    table, out = _proc_table(), []
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    todo = [root_pid] if root_pid in table else []
    while todo:
        pid = todo.pop(0)
        if not _is_zombie(pid):
            out.append(pid)
        todo += sorted(children.get(pid, []))
    return out


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (neither gone nor a zombie)."""
    return [p for p in pids if Path(f"/proc/{p}").exists() and not _is_zombie(p)]


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone: as dead as a zombie


def kill_role(role: str, rng: random.Random, root_pid: int | None = None) -> int | None:
    """SIGKILLs one process of `role` (picked by `rng`); its pid, or None when the role has none now."""
    pids = sorted(role_processes(root_pid)[role])
    if not pids:
        return None
    pid = rng.choice(pids)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return pid


class MemoryWatch:
    """The resident memory of the run's root process (its driver, "driver") and of every role process under
    it, sampled by `sample(t)`; `samples` maps (role, pid) to [(seconds, bytes), ...] (a restarted role is a
    new pid, a new series)."""

    def __init__(self, root_pid: int | None = None) -> None:
        self.root_pid = root_pid or os.getpid()
        self.samples: dict[tuple[str, int], list[tuple[float, float]]] = {}

    def sample(self, t: float) -> None:
        procs = [("driver", self.root_pid)]
        procs += [(role, pid) for role, pids in role_processes(self.root_pid).items() for pid in pids]
        for role, pid in procs:
            rss = _rss_bytes(pid)
            if rss is not None:
                self.samples.setdefault((role, pid), []).append((t, rss))

    def report(self, warmup_s: float, min_window_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """Per role: the largest slope over its processes (MB/min), each after its own first `warmup_s` (a
        restarted process loads its model first), counting only processes watched for at least
        `min_window_s` past their warm-up (a slope over a minute or two measures allocation transients —
        the first checkpoint, caches filling — not a leak) and at least 3 samples; how many processes that
        was (`measured`); the longest a process of the role lived (s); the largest RSS seen last (MB)."""
        out: dict[str, dict[str, Any]] = {}
        for (role, _pid), series in sorted(self.samples.items()):
            start = series[0][0] + warmup_s
            long_enough = series[-1][0] - start >= min_window_s
            slope = rss_slope_mb_per_min(series, start) if long_enough else None
            entry = out.setdefault(
                role, {"processes": 0, "measured": 0, "max_slope_mb_per_min": None, "rss_mb": 0.0}
            )
            entry["processes"] += 1
            entry["rss_mb"] = max(entry["rss_mb"], round(series[-1][1] / 1e6, 1))
            entry["longest_lived_s"] = max(entry.get("longest_lived_s", 0.0), series[-1][0] - series[0][0])
            if slope is not None:
                entry["measured"] += 1
                best = entry["max_slope_mb_per_min"]
                entry["max_slope_mb_per_min"] = round(slope if best is None else max(best, slope), 3)
        return out

    def series_mb(self) -> dict[str, list[list[float]]]:
        """Every process's samples as {"role/pid": [[seconds, MB], ...]} (the report keeps them)."""
        return {
            f"{role}/{pid}": [[round(t, 1), round(b / 1e6, 2)] for t, b in series]
            for (role, pid), series in sorted(self.samples.items())
        }


def _rss_bytes(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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
