"""The durable replay store: rollout trees between samplers, the backup actor and the learner.

Layout of a store directory::

    treeopsd-store.json          marker {"format": "treeopsd.replay_store", "layout_version": 1}
    LOCK                         flock held by the one writable ReplayStore (read-only opens skip it)
    segments/<seq>.raw.arrow     one Arrow IPC file per put_raw commit (seq: 12 digits, increasing)
    segments/<seq>.credited.arrow  one per put_credited commit
    consumed.log                 append-only records {"op":"batch",k,ids} / {"op":"rewind",to}, crc32 each
    quarantine/                  torn or corrupt files moved aside with a <name>.reason.json; never deleted

Durability contract (what the tests check):
  * put_raw / put_credited: returned ⇒ the whole commit is on disk (fsynced file, rename, fsynced dir).
    Present after a crash ⇒ the commit was started; a commit interrupted before its rename leaves only a
    temp file, which the next writable open quarantines. A reader never sees part of a commit.
  * States: raw → credited (a credited copy supersedes the raw one, by tree_id) → consumed.
  * lease_raw leases uncredited trees to one backup for `lease_s` seconds (in memory). A crashed backup's
    trees come back when the lease expires, on `release_raw`, or on reopen; crediting is idempotent (a
    later credited copy replaces the earlier one and keeps its queue position).
  * take_batch(n): the n oldest credited, unconsumed main trees (by first credit commit), each with its side
    trees (storage/linked.py), are recorded as batch k = watermark() in consumed.log (fsynced) *before*
    returning. So after any restart nothing is handed out twice. A crash after the record but before the
    learner trained batch k must not skip it: the learner checkpoints the watermark w of batches it has
    trained and calls `rewind_to(w)` on resume, which durably voids batches ≥ w and returns their trees to
    the queue at their old positions — with the same n, take_batch then hands out the same batches k = w,
    w+1, … again. Trained at most once, none skipped.
  * Recovery on a writable open: temp files, torn/corrupt segments (truncated, bad magic, unknown schema
    version, failing tree validation, duplicate ids) and a torn consumed.log tail are moved to quarantine/
    and listed in `recovery_report`; everything else stays readable. Read-only opens report, never move.

Staleness admission (AReaL; storage/admission.py): `admit(n)` reserves up to n tree starts, a commit uses
up reservations first, `release(n)` returns a crashed sampler's (reopen clears them: they are in memory).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa

from storage import store_files as sf
from storage.admission import Admission
from storage.durable import write_atomic
from storage.linked import Links
from storage.store_files import Entry, Loc, StoreError
from storage.tree_checks import check_trees
from storage.tree_codec import decode_trees, encode_trees, flat_columns, table_to_ipc
from system.tree import RolloutTree

__all__ = ["ReplayStore", "StoreError"]
Trees = Iterable[RolloutTree] | bytes | bytearray | memoryview  # trees, or their IPC file bytes (encode_ipc)

log = logging.getLogger("treeopsd.store")


class ReplayStore:
    """Durable tree store over a directory (see the module docstring). One writable handle per directory."""

    def __init__(
        self,
        directory: str | os.PathLike,
        create: bool = True,
        *,
        readonly: bool = False,
        validate: str = "full",
        lease_s: float = 300.0,
        eta: int | None = None,
        batch_size: int | None = None,
        cache_segments: int = 64,
    ):
        if validate not in ("full", "structure"):
            raise ValueError(f"validate must be 'full' or 'structure', got {validate!r}")
        self.root, self.readonly, self._validate = Path(directory), readonly, validate
        self._lease_s = lease_s
        self._mu = threading.RLock()
        self._segments: dict[int, tuple[Path, str, int]] = {}  # seq -> (path, kind, bytes)
        self._raw: dict[str, Loc] = {}
        self._credited: dict[str, Loc] = {}
        self._uncredited: dict[str, None] = {}  # ordered set, raw commit order
        self._pending: dict[str, None] = {}  # credited, unconsumed, in credit order
        self._credit_pos: dict[str, int] = {}
        self._summary: dict[str, sf.Summary] = {}
        self._links = Links()  # side trees -> their episode tree
        self._consumed: set[str] = set()
        self._batches: list[list[str]] = []
        self._leases: dict[str, float] = {}
        self._cache = sf.SegmentCache(lambda seq: self._segments[seq][0], cache_segments)
        self._admission = Admission(eta, batch_size)
        self.recovery_report: list[dict[str, Any]] = []
        self._lock_fd, self._log = -1, None
        sf.init_or_check(self.root, create and not readonly)
        if not readonly:
            self._lock_fd = sf.lock_store(self.root)
        self._next_seq = 1
        try:
            good = self._load_log()
            self._scan()
            if not readonly:
                self._log = sf.AppendLog(self.root / "consumed.log", good)
        except BaseException:
            self.close()
            raise

    # ---- open and recover -------------------------------------------------------------------------
    def _problem(self, path: Path, reason: str, committed: bool, move: Path | None = None) -> None:
        """Reports `path`; a writable open moves `move` (default: path itself) to quarantine/."""
        entry = {"file": str(path), "reason": reason, "committed": committed, "moved_to": None}
        if not self.readonly:
            entry["moved_to"] = str(sf.quarantine(self.root, move or path, reason))
            log.warning("replay store: quarantined %s: %s", path, reason)
        self.recovery_report.append(entry)

    def _load_log(self) -> int:
        path = self.root / "consumed.log"
        records, good, tail = sf.read_log(path)
        self._batches = sf.replay_log(records, path)
        self._consumed = {t for ids in self._batches for t in ids}
        if tail:  # an append whose fsync never finished: its take_batch/rewind never returned
            torn = self.root / "consumed.log.torn"
            if not self.readonly:
                write_atomic(torn, tail)  # the bytes go to quarantine before the log is cut
            self._problem(path, f"torn last record ({len(tail)} bytes) of an interrupted append", False, torn)
        return good

    def _scan(self) -> None:
        segdir = self.root / "segments"
        q = [p.name for p in sf.quarantined_files(self.root)]
        names = sorted(os.listdir(segdir)) if segdir.is_dir() else []
        seqs = [int(m[1]) for n in (*names, *q) if (m := re.search(r"(\d{12})\.", n))]
        self._next_seq = max(seqs, default=0) + 1  # never reuse a number, even a quarantined one
        for name in names:
            path, m = segdir / name, sf.SEGMENT_RE.match(name)
            if name.startswith(".tmp-"):
                self._problem(
                    path, "uncommitted temp file: its writer stopped before the commit's rename", False
                )
            elif m is None:
                self._problem(path, "unexpected file in segments/", True)
            else:
                try:
                    entries = sf.check_segment(path, int(m[1]), m[2], full=self._validate == "full")
                    dup = [e[0] for e in entries if e[0] in self._raw] if m[2] == "raw" else []
                    if dup:
                        raise StoreError(f"tree ids {dup[:3]} were already committed by an earlier segment")
                    self._apply(int(m[1]), path, m[2], entries)
                except (*sf.BAD_SEGMENT, StoreError) as e:
                    self._problem(path, f"{type(e).__name__}: {e}", True)

    def _apply(self, seq: int, path: Path, kind: str, entries: list[Entry]) -> None:
        self._segments[seq] = (path, kind, path.stat().st_size)
        for tid, loc, summary in entries:
            self._summary[tid] = summary
            self._links.add(tid, summary.episode)
            if kind == "raw":
                self._raw[tid] = loc
                if tid not in self._credited:
                    self._uncredited[tid] = None
                continue
            self._credited[tid] = loc
            self._uncredited.pop(tid, None)
            self._leases.pop(tid, None)
            if tid not in self._credit_pos:
                self._credit_pos[tid] = len(self._credit_pos)
                if tid not in self._consumed:
                    self._pending[tid] = None

    # ---- commits ------------------------------------------------------------------------------------
    def _writable(self) -> None:
        if self.readonly or self._log is None:
            raise StoreError(f"{self.root}: store is read-only or closed")

    def _prepare(self, kind: str, data: Trees) -> tuple[bytes, list[Entry]]:
        """(IPC file bytes, index entries) of a commit, checked once: trees are validated and encoded; bytes
        from a client (`tree_codec.encode_ipc`) are checked in place and kept as they are."""
        self._writable()
        if isinstance(data, bytes | bytearray | memoryview):
            return bytes(data), sf.check_ipc(data, self._next_seq, kind, full=self._validate == "full")
        trees = list(data)
        if not trees:
            raise ValueError("nothing to commit")
        for t in trees:
            if kind == "credited" and t.credit is None:
                raise ValueError(f"tree {t.tree_id!r}: put_credited needs a tree with credit")
        batch = encode_trees(trees)
        f = flat_columns(batch)
        check_trees(batch, f)  # a tree failing validation never reaches disk
        return table_to_ipc(batch), sf.batch_entries(self._next_seq, 0, batch, f)

    def _commit(self, kind: str, buf: bytes, entries: list[Entry]) -> int:
        ids = [e[0] for e in entries]
        if len(set(ids)) != len(ids):
            raise ValueError(f"tree ids repeat within one commit: {sorted(ids)[:5]}")
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        path = self.root / "segments" / f"{seq:012d}.{kind}.arrow"
        write_atomic(path, buf)
        self._apply(seq, path, kind, entries)
        return seq

    def put_raw(self, trees: Trees) -> int:
        """Commits new trees (RolloutTrees, or their IPC file bytes) atomically; returns the segment id.
        Tree ids must be new to the store."""
        with self._mu:
            buf, entries = self._prepare("raw", trees)
            old = [e[0] for e in entries if e[0] in self._summary]
            if old:
                raise ValueError(f"tree ids already in the store: {old[:5]}")
            seq = self._commit("raw", buf, entries)
            used = self._links.mains(e[0] for e in entries)
            self._admission.reserved = max(0, self._admission.reserved - used)
            return seq

    def put_credited(self, trees: Trees) -> int:
        """Commits credited copies (tree.credit set); each supersedes the raw copy of the same tree_id.

        A tree with no raw copy is accepted too (a pipeline without a backup actor)."""
        with self._mu:
            buf, entries = self._prepare("credited", trees)
            for tid, _, summary in entries:
                s = self._summary.get(tid)
                if s is not None and s.nodes != summary.nodes:
                    raise ValueError(f"tree {tid!r}: {summary.nodes} nodes but stored with {s.nodes}")
            return self._commit("credited", buf, entries)

    # ---- reads --------------------------------------------------------------------------------------
    def _current(self, tid: str) -> Loc:
        return self._credited.get(tid) or self._raw[tid]

    def read_columns(
        self, tree_ids: Iterable[str] | None = None, columns: list[str] | None = None
    ) -> pa.Table:
        """Current copies of the given trees (all if None) as a table over the mapped files, no copy."""
        with self._mu:
            ids = list(self._summary) if tree_ids is None else list(tree_ids)
            table = self._cache.table([self._current(t) for t in ids])
        return table if columns is None else table.select(columns)

    def get_trees(self, tree_ids: Iterable[str]) -> list[RolloutTree]:
        return decode_trees(self.read_columns(tree_ids), str(self.root))

    def tree_ids(self, state: str | None = None) -> list[str]:
        """Ids in a state ("raw" = uncredited, "credited" = waiting for a batch, "consumed"), or all."""
        with self._mu:
            pick = {None: self._summary, "raw": self._uncredited, "credited": self._pending}
            return sorted(self._consumed) if state == "consumed" else list(pick[state])

    def lease_raw_table(self, max_trees: int) -> pa.Table:
        """Leases up to max_trees uncredited trees (raw commit order) to the calling backup for `lease_s`."""
        with self._mu:
            now, out = time.monotonic(), []
            for tid in self._uncredited:
                if len(out) >= max_trees:
                    break
                if self._leases.get(tid, 0.0) <= now:
                    out.append(tid)
            self._leases.update((t, now + self._lease_s) for t in out)
            return self._cache.table([self._raw[t] for t in out])

    def lease_raw(self, max_trees: int) -> list[RolloutTree]:
        return decode_trees(self.lease_raw_table(max_trees), str(self.root))

    def lease_raw_ipc(self, max_trees: int) -> bytes:
        """`lease_raw` as IPC file bytes of the stored rows (for a store served by a Ray actor)."""
        return table_to_ipc(self.lease_raw_table(max_trees))

    def release_raw(self, tree_ids: Iterable[str]) -> None:
        with self._mu:
            for t in tree_ids:
                self._leases.pop(t, None)

    def take_batch_ids(self, n: int) -> list[str] | None:
        """Records batch k = watermark() durably and returns its tree ids; None if < n credited."""
        if n <= 0:
            raise ValueError(f"batch size must be positive, got {n}")
        with self._mu:
            self._writable()
            ids = None if len(self._pending) < n else self._links.select(self._pending, n, self._uncredited)
            if ids is None:
                return None
            self._log.append({"op": "batch", "k": len(self._batches), "ids": ids})  # type: ignore[union-attr]
            self._batches.append(ids)
            self._consumed.update(ids)
            for t in ids:
                del self._pending[t]
            return ids

    def take_batch_table(self, n: int) -> pa.Table | None:
        ids = self.take_batch_ids(n)
        return None if ids is None else self.read_columns(ids)

    def take_batch(self, n: int) -> list[RolloutTree] | None:
        """A fixed rollout batch of n credited trees, handed out exactly once (see rewind_to)."""
        return None if (table := self.take_batch_table(n)) is None else decode_trees(table, str(self.root))

    def take_batch_ipc(self, n: int) -> bytes | None:
        """`take_batch` as IPC file bytes of its rows (for a store served by a Ray actor)."""
        return None if (table := self.take_batch_table(n)) is None else table_to_ipc(table)

    def watermark(self) -> int:
        """Batches handed out so far = the id the next take_batch gets. The learner checkpoints this."""
        with self._mu:
            return len(self._batches)

    def batch_tree_ids(self, k: int) -> list[str]:
        with self._mu:
            return list(self._batches[k])

    def rewind_to(self, watermark: int) -> int:
        """Durably voids batches ≥ watermark (handed out, never trained); returns how many trees came back."""
        with self._mu:
            self._writable()
            if not 0 <= watermark <= len(self._batches):
                raise ValueError(f"watermark {watermark} outside 0..{len(self._batches)}")
            if watermark == len(self._batches):
                return 0
            self._log.append({"op": "rewind", "to": watermark})  # type: ignore[union-attr]
            back = [t for ids in self._batches[watermark:] for t in ids]
            del self._batches[watermark:]
            self._consumed.difference_update(back)
            self._pending.update((t, None) for t in back if t in self._credited)
            self._pending = dict.fromkeys(sorted(self._pending, key=self._credit_pos.__getitem__))
            return len(back)

    # ---- staleness admission -------------------------------------------------------------------------
    def set_learner_version(self, version: int) -> None:
        with self._mu:
            self._admission.learner_version = int(version)

    def limit_lag(self, lag: int | None) -> None:
        """Admits at most `lag` versions of staleness (None: `eta` alone): set from measured drift."""
        with self._mu:
            self._admission.limit_lag(lag)

    def admission_capacity(self, eta: int | None = None, batch_size: int | None = None) -> int:
        """(eta + v + 1)·B − produced (storage/admission.py); may be negative when the learner fell behind."""
        with self._mu:
            produced = len(self._summary) - len(self._links.episode)  # main trees
            return self._admission.capacity(produced, eta, batch_size)

    def admit(self, n: int, eta: int | None = None, batch_size: int | None = None) -> int:
        """Reserves up to n tree starts for a sampler; returns how many were granted."""
        with self._mu:
            granted = max(0, min(n, self.admission_capacity(eta, batch_size)))
            self._admission.reserved += granted
            return granted

    def release(self, n: int) -> None:
        """Returns unused reservations (a sampler crashed or stopped before committing them)."""
        with self._mu:
            self._admission.reserved = max(0, self._admission.reserved - n)

    # ---- reporting and lifetime ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._mu:
            now = time.monotonic()
            versions: Counter[int] = Counter()
            for s in self._summary.values():
                versions.update(dict(s.versions))
            kinds = Counter(kind for _, kind, _ in self._segments.values())
            summaries = self._summary.values()
            return {
                "trees": {
                    "raw": len(self._uncredited),
                    "leased": sum(1 for t in self._uncredited if self._leases.get(t, 0.0) > now),
                    "credited": len(self._pending),
                    "consumed": len(self._consumed),
                    "total": len(self._summary),
                },
                "side_trees": self._links.stats(self._summary),
                **{k: sum(getattr(s, k) for s in summaries) for k in ("nodes", "leaves", "tokens")},
                "policy_versions": {str(int(v)): int(c) for v, c in sorted(versions.items())},
                "segments": {"raw": 0, "credited": 0, **kinds, "total": len(self._segments)},
                "bytes": sum(size for _, _, size in self._segments.values()),
                "quarantined": len(sf.quarantined_files(self.root)),
                "batches_handed_out": len(self._batches),
                "admission": self._admission.stats(),
            }

    def close(self) -> None:
        with self._mu:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1
            self._cache.clear()

    def __enter__(self) -> ReplayStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
