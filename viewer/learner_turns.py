"""The learner's per-turn records (learner/turn_record.py: RUN_DIR/learner_turns/batch_<k>.rank<r>.arrow),
read-only.

    turns = LearnerTurns(run_dir)
    turns.refresh()                      # new or rewritten files (a batch trained again after a rewind)
    turns.mismatch(tree_id)              # mean k3 of π_θ against μ over the tree's trained tokens, or None
    turns.of_tree(tree_id, batch)        # node id -> {s, ell, mass, z, minibatch, version, logp by token}

The file layout is the learner's; this module knows it only through the column names.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

DIRNAME = "learner_turns"  # learner/turn_record.py DIRNAME (the viewer does not import the learner)
FILE_RE = re.compile(r"^batch_(\d{6,})\.rank(\d+)\.arrow$")
SUMMARY_COLUMNS = ["tree_id", "k3_sum", "k3_n"]


def _read(path: Path, columns: list[str] | None = None) -> pa.Table:
    table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    return table if columns is None else table.select(columns)


class LearnerTurns:
    def __init__(self, run_dir: Path):
        self.dir = run_dir / DIRNAME
        self._mu = threading.Lock()
        self._seen: dict[str, tuple[int, int]] = {}  # file name -> (mtime_ns, size)
        self._k3: dict[str, dict[str, tuple[float, int]]] = {}  # file name -> tree -> (Σ k3, n)
        self.problems: dict[str, str] = {}

    def refresh(self) -> None:
        try:
            entries = [e for e in self.dir.iterdir() if FILE_RE.match(e.name)] if self.dir.is_dir() else []
        except OSError:
            return
        for path in entries:
            try:
                st = path.stat()
                if self._seen.get(path.name) == (st.st_mtime_ns, st.st_size):
                    continue
                sums = _tree_sums(_read(path, SUMMARY_COLUMNS))
            except (OSError, pa.ArrowException, KeyError) as e:
                self.problems[path.name] = f"{path}: unreadable learner record ({e})"
                continue
            with self._mu:
                self._seen[path.name] = (st.st_mtime_ns, st.st_size)
                self._k3[path.name] = sums
                self.problems.pop(path.name, None)

    def mismatch(self, tree_id: str) -> float | None:
        with self._mu:
            parts = [f[tree_id] for f in self._k3.values() if tree_id in f]
        n = sum(p[1] for p in parts)
        return sum(p[0] for p in parts) / n if n else None

    def of_tree(self, tree_id: str, batch: int | None) -> dict[int, dict[str, Any]]:
        """The tree's turns as the learner trained them in `batch` (every rank's file), by node id."""
        if batch is None or not self.dir.is_dir():
            return {}
        out: dict[int, dict[str, Any]] = {}
        for path in sorted(self.dir.glob(f"batch_{batch:06d}.rank*.arrow")):
            try:
                table = _read(path)
            except (OSError, pa.ArrowException) as e:
                self.problems[path.name] = f"{path}: unreadable learner record ({e})"
                continue
            ids = table.column("tree_id").to_pylist()
            for i in (i for i, t in enumerate(ids) if t == tree_id):
                row = table.slice(i, 1).to_pylist()[0]
                out[int(row.pop("node_id"))] = row
        return out


def _tree_sums(table: pa.Table) -> dict[str, tuple[float, int]]:
    ids = table.column("tree_id").to_pylist()
    k3 = np.asarray(table.column("k3_sum").to_pylist(), dtype=np.float64)
    n = np.asarray(table.column("k3_n").to_pylist(), dtype=np.int64)
    out: dict[str, tuple[float, int]] = {}
    for t, a, b in zip(ids, k3, n, strict=True):
        s, c = out.get(t, (0.0, 0))
        out[t] = (s + float(a), c + int(b))
    return out
