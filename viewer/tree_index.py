"""The tree list: a store's segments indexed newest first, as far as a page needs, then in the background.

    index = TreeIndex(run)                    # nothing read yet
    index.start()                             # a daemon thread indexes every segment, newest first
    page = index.page(offset=0, limit=50, filters={"no_signal": True}, sort="newest")

A segment is read once (segments are immutable after their commit's rename, storage/store_files.py); a
directory listing at most once a second picks up new commits of a running job. Newest first, a tree's
credited copy is met before its raw one, so the credited row wins, as in the store. A page in store order
waits only for the segments it shows; a filtered or sorted page waits up to `wait_s` and says how much of
the store it covers (`complete`), and the page asks again until it is complete. Only the list rows are kept
in memory (segments/summaries.py), never a decoded tree or a token column.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from storage import store_files as sf
from viewer.learner_turns import LearnerTurns
from viewer.run_files import RunFiles
from viewer.summaries import segment_rows

SORTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "newest": lambda r: (r["first_seq"], r["row0"]),
    "step": lambda r: (r["step"] if r["step"] is not None else 1 << 40, r["first_seq"]),
    "task": lambda r: (r["task"], r["first_seq"]),
    "spread": lambda r: (
        (r["r_max"] - r["r_min"]) if r["r_max"] is not None else -1.0,
        r["r_sd"] or 0.0,
        r["first_seq"],
    ),
    "size": lambda r: (r["nodes"], r["tokens"]),
    "leaves": lambda r: (r["leaves"], r["nodes"]),
    "mismatch": lambda r: (r["mismatch"] if r["mismatch"] is not None else -1.0, r["first_seq"]),
}


class TreeIndex:
    def __init__(self, run: RunFiles, turns: LearnerTurns | None = None, list_every_s: float = 1.0):
        self.run, self.turns = run, turns or LearnerTurns(run.root)
        self._mu = threading.Condition()
        self._rows: dict[str, dict[str, Any]] = {}
        self._done: set[int] = set()  # segment seqs indexed (or failed)
        self._todo: list[tuple[int, str, Path]] = []  # newest first
        self._paths: dict[int, Path] = {}
        self.problems: dict[str, str] = {}  # segment name -> one line
        self._listed_at, self._list_every = -1e9, list_every_s
        self._batches: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- reading segments ---------------------------------------------------------------------------
    def _list(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._listed_at < self._list_every:
            return
        self._listed_at = now
        segdir = self.run.store / "segments"
        try:
            names = os.listdir(segdir) if segdir.is_dir() else []
        except OSError:
            names = []
        found = {int(m[1]): (m[2], segdir / n) for n in names if (m := sf.SEGMENT_RE.match(n))}
        batches, problem = self.run.batches()
        self.turns.refresh()
        with self._mu:
            self._batches = batches
            if problem:
                self.problems["consumed.log"] = problem
            gone = set(self._paths) - set(found)  # moved to quarantine/ by a writer's recovery
            for tid in [t for t, r in self._rows.items() if r["loc"][0] in gone]:
                del self._rows[tid]
            self._done -= gone
            self._paths = {seq: path for seq, (_, path) in found.items()}
            queued = {s for s, _, _ in self._todo}
            new = [(s, k, p) for s, (k, p) in found.items() if s not in self._done and s not in queued]
            self._todo = sorted([*self._todo, *new], key=lambda x: -x[0])
            self._todo = [t for t in self._todo if t[0] in found]

    def _index_one(self) -> bool:
        """Indexes the newest segment not yet read; False when none is left."""
        with self._mu:
            if not self._todo:
                return False
            seq, kind, path = self._todo.pop(0)
        try:
            rows = segment_rows(path, seq, kind)
            problem = None
        except (*sf.BAD_SEGMENT, KeyError, IndexError) as e:
            rows, problem = [], f"{path.name}: cannot read this segment ({type(e).__name__}: {e})"
        with self._mu:
            self._done.add(seq)
            if problem:
                self.problems[path.name] = problem.replace("\n", " ")
            for row in rows:
                old = self._rows.get(row["id"])
                row["first_seq"] = min(seq, old["first_seq"]) if old else seq
                if old is None or (row["kind"] == "credited" and old["loc"][0] < seq):
                    self._rows[row["id"]] = row
                else:
                    old["first_seq"] = row["first_seq"]
            self._mu.notify_all()
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._list()
            if not self._index_one():
                self._stop.wait(self._list_every)

    def start(self) -> None:
        if self._thread is None:
            self._list(force=True)
            self._thread = threading.Thread(target=self._run, name="view-index", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def index_all(self) -> None:
        """Every segment now (the export and the benchmark's full-index figure)."""
        self._list(force=True)
        while self._index_one():
            pass

    # ---- pages --------------------------------------------------------------------------------------
    def _wait(self, enough: Callable[[], bool], wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        if self._thread is None:  # no background thread: index inline
            self._list()
            while not enough() and time.monotonic() < deadline and self._index_one():
                pass
            return
        with self._mu:
            while not enough() and (left := deadline - time.monotonic()) > 0:
                self._mu.wait(min(left, 0.05))

    def location(self, tree_id: str) -> tuple[Path, tuple[int, int, int, int], int | None] | None:
        with self._mu:
            row = self._rows.get(tree_id)
            if row is None:
                return None
            return self._paths.get(row["loc"][0], Path("?")), row["loc"], self._batches.get(tree_id)

    def row(self, tree_id: str) -> dict[str, Any] | None:
        with self._mu:
            row = self._rows.get(tree_id)
            return None if row is None else self._public(row)

    def _public(self, row: dict[str, Any]) -> dict[str, Any]:
        """A row as the page gets it: `step` is the learner step that trained the tree (batch k of
        consumed.log is step k + 1, tensorboard's step), None while it waits."""
        batch = self._batches.get(row["id"])
        state = "consumed" if batch is not None else ("credited" if row["credited"] else "raw")
        out = {k: v for k, v in row.items() if k != "loc"}
        step = None if batch is None else batch + 1
        out.update(step=step, batch=batch, state=state, mismatch=self.turns.mismatch(row["id"]))
        return out

    def page(
        self,
        offset: int = 0,
        limit: int = 50,
        filters: dict[str, Any] | None = None,
        sort: str = "newest",
        descending: bool = True,
        wait_s: float = 1.0,
    ) -> dict[str, Any]:
        filters = {k: v for k, v in (filters or {}).items() if v not in (None, False, "")}
        if sort not in SORTS:
            raise ValueError(f"sort must be one of {sorted(SORTS)}, got {sort!r}")
        plain = not filters and sort == "newest" and descending
        self._wait(lambda: self.complete() or (plain and len(self._rows) >= offset + limit), wait_s)
        with self._mu:
            rows = [self._public(r) for r in self._rows.values()]
            complete = not self._todo
            segments = (len(self._done), len(self._done) + len(self._todo))
            problems = sorted(self.problems.values()) + sorted(self.turns.problems.values())
        rows = [r for r in rows if matches(r, filters)]
        rows.sort(key=SORTS[sort], reverse=descending)
        return {
            "rows": rows[offset : offset + limit],
            "total": len(rows),
            "offset": offset,
            "complete": complete,
            "segments": {"indexed": segments[0], "total": segments[1]},
            "problems": problems,
        }

    def complete(self) -> bool:
        return not self._todo


def matches(row: dict[str, Any], filters: dict[str, Any]) -> bool:
    if filters.get("no_signal") and not row["no_signal"]:
        return False
    if filters.get("truncated") and not row["truncated"]:
        return False
    if filters.get("credited") and not row["credited"]:
        return False
    if (m := filters.get("mismatch_min")) is not None and (row["mismatch"] is None or row["mismatch"] < m):
        return False
    text = str(filters.get("q", "")).lower()
    return not text or text in row["id"].lower() or text in row["task"].lower()
