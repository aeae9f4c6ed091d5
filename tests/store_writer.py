"""Tree factories for the store tests, and the child processes that the crash/restart tests SIGKILL.

Run as a script (the parent reads its stdout line by line; every line is flushed):

    python tests/store_writer.py write DIR FIRST_ID [DIE_AT]
        opens the store, prints "ready", then commits trees FIRST_ID, FIRST_ID+1, ... (1-3 per commit, every
        fifth commit large) forever. Prints "begin <ids>" before a commit and "ok <ids>" after it returned.
    python tests/store_writer.py consume DIR N [DIE_AT]
        prints "ready", then take_batch(N) until None; prints "batch <k> <ids>" after each returned.
    python tests/store_writer.py read DIR MAX_S
        prints "ready", then polls: opens the store read-only, reads every visible tree and checks it against
        make_tree; prints "poll <k> <temp files seen> <new ids>" per poll, or "error <what>" (a committed
        file reported, a visible tree lost or different). When stdin closes (or after MAX_S): a last poll,
        then "done".

DIE_AT makes the child SIGKILL itself at an exact point of its 2nd commit/take (``torn_tmp``: half the temp
file written; ``before_rename``; ``after_rename``: renamed, directory not yet fsynced; ``log_torn``: half a
consumed.log record written; ``after_log``: record fsynced, take_batch not yet returned). Without it the
parent kills the child at a random moment.
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import BinaryIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from storage import durable, store_files
from storage.replay_store import ReplayStore
from system.tree import NodeCredit, RolloutTree, make_node


def make_tree(i: int, big: bool = False) -> RolloutTree:
    """Deterministic tree number i (a parent can rebuild it to compare): 1-6 turns, random branching."""
    rng = np.random.default_rng(i)
    turns = int(rng.integers(1, 7))
    parents = [-1, 0] + [int(rng.integers(0, k)) for k in range(2, turns + 1)]
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    inner = set(parents)
    nodes = [make_node(0, -1, 0, obs_tokens=rng.integers(0, 1000, int(rng.integers(0, 8))))]
    size = 20_000 if big else 12
    for j in range(1, turns + 1):
        n = int(rng.integers(0, size))
        mask = rng.random(n) < 0.8
        lp = np.where(mask, -rng.exponential(1.0, n), np.nan)
        obs = rng.integers(0, 1000, int(rng.integers(0, 4)))
        reward = None if j in inner else float(rng.integers(0, 2))
        version = int(rng.integers(0, 3))
        nodes.append(
            make_node(j, parents[j], depth[j], rng.integers(0, 1000, n), mask, lp, obs, version, reward)
        )
    return RolloutTree.build(f"t{i}", nodes, prompt_id=f"p{i % 5}", meta={"i": str(i)})


def credited(tree: RolloutTree, tau: float | None = 1.5) -> RolloutTree:
    n = len(tree.nodes)
    z = np.array([np.nan if k in set(tree.leaves) else 0.0 for k in range(n)])
    v = np.linspace(-1.0, 1.0, n)
    return tree.with_credit(NodeCredit(z, v, 1.0 / (1.0 + np.exp(-v)), tau))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(die_at: str) -> None:
    """Wraps store internals so the child kills itself at `die_at` on the 2nd hit (the 1st one succeeds)."""
    hits: dict[str, int] = {}

    def second(point: str) -> bool:
        hits[point] = hits.get(point, 0) + 1
        return die_at == point and hits[point] == 2

    fsync, rename, append = durable.fsync_file, os.rename, store_files.AppendLog.append

    def _fsync(f: BinaryIO) -> None:
        segment = f"{os.sep}segments{os.sep}" in f.name
        if segment and second("torn_tmp"):
            f.flush()
            os.truncate(f.name, os.path.getsize(f.name) // 2)
            _die()
        fsync(f)

    def _rename(src: str | Path, dst: str | Path) -> None:
        segment = f"{os.sep}segments{os.sep}" in str(dst)
        if segment and second("before_rename"):
            _die()
        rename(src, dst)
        if segment and second("after_rename"):
            _die()

    def _append(self: store_files.AppendLog, record: dict) -> None:
        if second("log_torn"):
            data = store_files._line(record)
            os.write(self._fd, data[: len(data) // 2])
            _die()
        append(self, record)
        if second("after_log"):
            _die()

    durable.fsync_file, store_files.AppendLog.append = _fsync, _append  # type: ignore[method-assign]
    os.rename = _rename  # type: ignore[assignment]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def write(directory: str, first: int) -> None:
    store = ReplayStore(directory, validate="structure")  # the parent does the full checks
    _say("ready")
    i, commit = first, 0
    rng = np.random.default_rng(first)
    while True:
        ids = list(range(i, i + int(rng.integers(1, 4))))
        trees = [make_tree(k, big=commit % 5 == 4 and k == ids[0]) for k in ids]
        _say("begin " + " ".join(map(str, ids)))
        store.put_raw(trees)
        _say("ok " + " ".join(map(str, ids)))
        i, commit = ids[-1] + 1, commit + 1


def consume(directory: str, n: int) -> None:
    store = ReplayStore(directory, validate="structure")
    _say("ready")
    while (batch := store.take_batch(n)) is not None:
        k = store.watermark() - 1
        _say(f"batch {k} " + " ".join(t.tree_id for t in batch))
    _say("done")


def _poll(directory: str, seen: set[str]) -> tuple[list[int], int]:
    """One read-only open: (ids new since the last poll, temp files reported). Raises on a broken promise."""
    with ReplayStore(directory, create=False, readonly=True, validate="structure") as store:
        ids, report = store.tree_ids(), store.recovery_report
        rows = store.read_columns(ids, ["tree_id"]).column("tree_id").to_pylist()  # maps every segment
        new = [t for t in ids if t not in seen]
        trees = store.get_trees(new)
    bad = [r for r in report if r["committed"] or r["moved_to"] or "temp file" not in r["reason"]]
    if bad:
        raise AssertionError(f"a read-only open reported or moved more than a temp file: {bad}")
    if lost := seen - set(ids):
        raise AssertionError(f"visible before, gone now: {sorted(lost)[:5]}")
    if set(rows) != set(ids):
        raise AssertionError(f"read_columns rows {len(set(rows))} trees, tree_ids {len(ids)}")
    for tree in trees:
        i = int(tree.tree_id[1:])
        if not (tree.equals(make_tree(i)) or tree.equals(make_tree(i, big=True))):
            raise AssertionError(f"{tree.tree_id} differs from make_tree({i})")
    seen.update(new)
    return sorted(int(t[1:]) for t in new), len(report)


def read(directory: str, max_s: int) -> None:
    seen: set[str] = set()
    deadline = time.monotonic() + max_s
    _say("ready")
    for k in itertools.count():
        last = bool(select.select([sys.stdin], [], [], 0)[0]) or time.monotonic() > deadline  # stdin closed
        try:
            new, temp = _poll(directory, seen)
            _say(f"poll {k} {temp} " + " ".join(map(str, new)))
        except Exception as e:  # reported to the parent, which fails the test; keep polling
            _say(f"error {type(e).__name__}: {e}".replace("\n", " "))
        if last:
            break
    _say("done" if time.monotonic() <= deadline else f"error no stop within {max_s} s")


if __name__ == "__main__":
    mode, directory, arg = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if len(sys.argv) > 4:
        _arm(sys.argv[4])
    {"write": write, "consume": consume, "read": read}[mode](directory, arg)
