"""The soak's parts: find this run's role processes, kill one on a schedule, watch resident memory, and audit
the store afterwards from its own files (`treeopsd soak`, launch/cmd_soak.py; tests/ray/test_supervision.py).

    killer = Killer(every_s=30, roles=("sampler", "backup", "store", "learner"), seed=0); killer.start()
    memory = MemoryWatch(interval_s=10); memory.start()
    ...  # the run
    killer.stop(); memory.stop()
    audit_store(run_dir / "store")     # trees committed, lost, duplicated, half-visible

Processes are found through /proc, without a Ray call (a call to a busy actor waits behind its current one,
so asking an actor for its pid would only ever kill it between calls): a role's actor process is titled
`ray::<ActorClass>` (or `ray::<ActorClass>.<method>` while it runs one) by Ray, and only descendants of this
process count — the raylet this driver started is their parent — so nothing of another Ray instance on the
machine is ever touched. Local Ray only (no RAY_ADDRESS).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.restart_policy import rss_slope_mb_per_min

ROLE_CLASSES = {
    "sampler": ("SamplerActor",),
    "backup": ("BackupActor",),
    "store": ("StoreActor",),
    "learner": ("LearnerActor", "LearnerRankActor"),
}


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


class _Periodic(threading.Thread):
    def __init__(self, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.interval_s, self.t0, self._done = interval_s, time.monotonic(), threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.tick(time.monotonic() - self.t0)

    def tick(self, t: float) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=30)


class Killer(_Periodic):
    """Every `every_s` seconds, SIGKILLs a random process of a random role (seeded); `kills` records
    (seconds since start, role, pid)."""

    def __init__(self, every_s: float, roles: Sequence[str], seed: int = 0, root_pid: int | None = None):
        super().__init__(every_s)
        self.roles, self.rng, self.root_pid = list(roles), random.Random(seed), root_pid or os.getpid()
        self.kills: list[tuple[float, str, int]] = []

    def tick(self, t: float) -> None:
        for role in self.rng.sample(self.roles, len(self.roles)):  # a role that is down now: the next one
            pid = kill_role(role, self.rng, self.root_pid)
            if pid is not None:
                self.kills.append((round(t, 1), role, pid))
                return


class MemoryWatch(_Periodic):
    """Every `interval_s`, the resident memory of every role process and of this driver; `samples` maps
    (role, pid) to [(seconds since start, bytes), ...] (a restarted role is a new pid, a new series)."""

    def __init__(self, interval_s: float, root_pid: int | None = None) -> None:
        super().__init__(interval_s)
        self.root_pid = root_pid or os.getpid()
        self.samples: dict[tuple[str, int], list[tuple[float, float]]] = {}

    def tick(self, t: float) -> None:
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


def audit_store(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What the store's own files say after a run (read-only open; moves nothing): trees committed, lost
    (a trained tree it no longer holds, or one in no state), duplicated (in two batches, or a raw commit
    refused as a repeat), half-visible (a committed segment that does not decode); and what the restarts
    left in quarantine/: commits killed before their rename and torn log tails (never visible)."""
    from storage.replay_store import ReplayStore
    from storage.store_files import REASON_SUFFIX

    with ReplayStore(directory, create=False, readonly=True) as store:
        stats, report = store.stats(), store.recovery_report
        batches = [store.batch_tree_ids(k) for k in range(store.watermark())]
        held = set(store.tree_ids())
    trained = [t for ids in batches for t in ids]
    trees = stats["trees"]
    in_no_state = trees["total"] - trees["raw"] - trees["credited"] - trees["consumed"]
    reasons = []
    for path in sorted((Path(directory) / "quarantine").glob(f"*{REASON_SUFFIX}")):
        reasons.append((path.name, json.loads(path.read_text())["reason"]))
    repeats = [n for n, r in reasons if "already committed" in r]
    interrupted = [n for n, r in reasons if n.startswith("tmp-") or "torn" in r]
    corrupt = [n for n, r in reasons if n not in repeats and n not in interrupted]
    return {
        "trees_committed": trees["total"],
        "trees_trained": len(trained),
        "batches": len(batches),
        "trees_lost": sum(t not in held for t in trained) + in_no_state,
        "trees_duplicated": len(trained) - len(set(trained)) + len(repeats),
        "trees_half_visible": len(corrupt) + sum(1 for r in report if r["committed"]),
        "interrupted_commits": len(interrupted),
        "quarantined": stats["quarantined"],
    }
