"""Durable file primitives under the replay store: atomic segment commits, quarantine, the consumed log.

Commit protocol (one segment = one commit, by `storage.durable.write_atomic`): ``segments/.tmp-<name>``
→ fsync the file → rename to ``segments/<name>`` → fsync the directory. A rename is atomic, so a reader sees
the whole segment or none of it; a crash leaves at most a ``.tmp-`` file, which recovery moves to
``quarantine/``. A segment's bytes are an Arrow IPC *file* (random access to its record batches, memory-mapped
without copies): exactly the bytes `tree_codec.encode_ipc` produces, so a commit writes what it received.

The consumed log is append-only text, one record per line: ``<crc32 hex8> <json>\\n``, fsynced per append.
A bad or unterminated *last* line is a torn append (its call never returned) and is cut off, after copying
the bytes to ``quarantine/``; a bad line followed by good ones is corruption and is refused (`LogError`).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from storage.durable import fsync_dir, write_atomic
from storage.linked import episode_links
from storage.tree_checks import check_trees
from storage.tree_codec import SCHEMA, FlatColumns, TreeCodecError, check_schema, flat_columns
from system.tree import TreeValidationError

REASON_SUFFIX = ".reason.json"
MARKER = "treeopsd-store.json"
FORMAT, LAYOUT_VERSION = "treeopsd.replay_store", 1
SEGMENT_RE = re.compile(r"^(\d{12})\.(raw|credited)\.arrow$")
# UnicodeDecodeError: a damaged field name or metadata key, which pyarrow decodes as UTF-8 when asked for it
BAD_SEGMENT = (pa.ArrowException, OSError, TreeCodecError, TreeValidationError, UnicodeDecodeError)


class StoreError(RuntimeError):
    """A directory that is not a usable store, or an operation the store refuses."""


class LogError(StoreError):
    """The consumed log is corrupt in a way that cannot be a torn append."""


def read_segment(path: Path) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """Memory-maps an IPC file; the batches view the mapping (no copy). Raises pa.ArrowException/OSError."""
    reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    return reader.schema, [reader.get_batch(i) for i in range(reader.num_record_batches)]


def quarantine(root: Path, path: Path, reason: str) -> Path:
    """Moves `path` to root/quarantine/ (never deletes) beside a reason file; returns the new path."""
    qdir = root / "quarantine"
    qdir.mkdir(exist_ok=True)
    base = path.name.lstrip(".")  # a hidden .tmp- file stays visible in the quarantine
    dest, k = qdir / base, 0
    while dest.exists() or dest.with_name(dest.name + REASON_SUFFIX).exists():
        k += 1
        dest = qdir / f"{base}.{k}"
    info = {"file": str(path.relative_to(root)), "reason": reason, "time": time.time()}
    write_atomic(dest.with_name(dest.name + REASON_SUFFIX), json.dumps(info, indent=1).encode())
    os.rename(path, dest)
    fsync_dir(qdir)
    fsync_dir(path.parent)
    return dest


def quarantined_files(root: Path) -> list[Path]:
    qdir = root / "quarantine"
    if not qdir.is_dir():
        return []
    return sorted(p for p in qdir.iterdir() if not p.name.endswith(REASON_SUFFIX))


# ---- consumed log ---------------------------------------------------------------------------------------
def _line(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(line: bytes) -> dict[str, Any] | None:
    head, _, body = line.partition(b" ")
    try:
        if len(head) != 8 or int(head, 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_log(path: Path) -> tuple[list[dict[str, Any]], int, bytes]:
    """(records, length of the good prefix, torn tail bytes). Raises LogError on mid-file corruption."""
    if not path.exists():
        return [], 0, b""
    data = path.read_bytes()
    records, good = [], 0
    lines = data.split(b"\n")
    for i, raw in enumerate(lines[:-1]):  # every element but the last ended with a newline
        rec = _parse(raw)
        if rec is None:
            if any(_parse(x) is not None for x in lines[i + 1 : -1]):
                raise LogError(f"{path}: line {i + 1} fails its checksum but later records are intact")
            return records, good, data[good:]
        records.append(rec)
        good += len(raw) + 1
    return records, good, data[good:]


def replay_log(records: list[dict[str, Any]], path: Path) -> list[list[str]]:
    """Applies batch/rewind records in order; returns the tree ids of the live batches 0..k-1."""
    batches: list[list[str]] = []
    for i, rec in enumerate(records):
        if rec.get("op") == "batch" and rec.get("k") == len(batches):
            batches.append([str(t) for t in rec["ids"]])
        elif rec.get("op") == "rewind" and 0 <= rec.get("to", -1) <= len(batches):
            del batches[rec["to"] :]
        else:
            raise LogError(f"{path}: record {i + 1} is out of sequence: {rec}")
    return batches


class AppendLog:
    """Append-only, fsync-per-record writer for the consumed log."""

    def __init__(self, path: Path, good_length: int):
        new = not path.exists()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, good_length)  # drop a torn tail (already copied to quarantine)
        os.lseek(self._fd, good_length, os.SEEK_SET)
        os.fsync(self._fd)
        if new:
            fsync_dir(path.parent)

    def append(self, record: dict[str, Any]) -> None:
        data = _line(record)
        written = 0
        while written < len(data):
            written += os.write(self._fd, data[written:])
        os.fsync(self._fd)  # the caller's return is the acknowledgement: durable before it

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# ---- marker ---------------------------------------------------------------------------------------------
def _check_marker(root: Path) -> None:
    marker = root / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"{marker}: unreadable store marker ({e})") from e
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise StoreError(f"{marker}: not a treeopsd replay store marker")
    if info.get("layout_version") != LAYOUT_VERSION:
        raise StoreError(
            f"{marker}: store layout version {info.get('layout_version')!r} is not supported "
            f"(this build: {LAYOUT_VERSION})"
        )


def init_or_check(root: Path, create: bool) -> None:
    """Checks the marker; creates an empty store only in a missing or empty directory when `create`."""
    if root.exists() and not root.is_dir():
        raise StoreError(f"{root}: not a directory, so not a treeopsd replay store")
    if (root / MARKER).exists():
        return _check_marker(root)
    if root.exists() and any(root.iterdir()):
        raise StoreError(f"{root}: not a treeopsd replay store (no {MARKER}); refusing a non-empty directory")
    if not create:
        what = "does not exist" if not root.exists() else "is empty"
        raise StoreError(f"{root}: no treeopsd replay store here (the directory {what})")
    for sub in ("segments", "quarantine"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    write_atomic(root / MARKER, json.dumps({"format": FORMAT, "layout_version": LAYOUT_VERSION}).encode())


# ---- segment index entries ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loc:
    """Where a tree lives: segment seq, record batch, row range."""

    seq: int
    batch: int
    row0: int
    row1: int


@dataclass(frozen=True)
class Summary:
    nodes: int
    leaves: int
    tokens: int
    versions: tuple[tuple[int, int], ...]  # (policy_version, turns)
    episode: str | None = None  # a side tree's episode tree (meta `episode_tree`: storage/linked.py)


Entry = tuple[str, Loc, Summary]


def summaries(f: FlatColumns) -> list[Summary]:
    """Per-tree node/leaf/token counts and version histogram, vectorized over the batch's rows."""
    starts = f.tree_starts
    tree = np.repeat(np.arange(len(starts) - 1, dtype=np.int64), np.diff(starts))
    turn = f.parent >= 0
    is_parent = np.isin((tree << 32) + f.node_id, ((tree << 32) + f.parent)[turn])
    leaf = turn & ~is_parent
    toks = f.tokens.lengths + f.obs_tokens.lengths
    out = []
    for k in range(len(starts) - 1):
        r = slice(int(starts[k]), int(starts[k + 1]))
        v, c = np.unique(f.policy_version[r][turn[r]], return_counts=True)
        hist = tuple(zip(v.tolist(), c.tolist(), strict=True))
        out.append(Summary(r.stop - r.start, int(leaf[r].sum()), int(toks[r].sum()), hist))
    return out


def batch_entries(seq: int, bi: int, batch: pa.RecordBatch, f: FlatColumns) -> list[Entry]:
    starts, links = f.tree_starts.tolist(), episode_links(batch, f)
    return [
        (tid, Loc(seq, bi, starts[k], starts[k + 1]), replace(s, episode=links[k]))
        for k, (tid, s) in enumerate(zip(f.tree_ids, summaries(f), strict=True))
    ]


def _as_schema(batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` under SCHEMA: check_schema accepts a file whose nullability flags differ (nulls are checked
    on read), which Table.from_batches would refuse; the columns are the same, only the labels change."""
    if batch.schema.equals(SCHEMA, check_metadata=False):
        return batch
    return pa.RecordBatch.from_arrays(batch.columns, schema=SCHEMA)


def check_segment(path: Path, seq: int, kind: str, full: bool) -> list[Entry]:
    """Index entries of a committed segment; raises (BAD_SEGMENT or StoreError) if any part is bad."""
    return check_batches(*read_segment(path), seq, kind, full)


def check_ipc(buf: bytes | memoryview, seq: int, kind: str, full: bool) -> list[Entry]:
    """The same checks on the IPC file bytes a client sent (`tree_codec.encode_ipc`), before they are
    committed as they are. Stream-format bytes are refused: a segment needs the file format."""
    if bytes(memoryview(buf)[:6]) != b"ARROW1":
        raise StoreError("expected Arrow IPC file bytes (tree_codec.encode_ipc), not the stream format")
    reader = pa.ipc.open_file(pa.py_buffer(buf))
    batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    return check_batches(reader.schema, batches, seq, kind, full)


def check_batches(
    schema: pa.Schema, batches: list[pa.RecordBatch], seq: int, kind: str, full: bool
) -> list[Entry]:
    check_schema(schema)
    entries: list[Entry] = []
    for bi, b in enumerate(batches):
        b.validate(full=True)  # offsets and buffers in bounds before anything touches them
        f = flat_columns(b)
        if kind == "credited" and not f.has_credit.all():
            raise StoreError("a credited segment holds a tree without credit")
        if full:
            check_trees(b, f)  # every tree must pass validate_tree's rules
        entries.extend(batch_entries(seq, bi, b, f))
    ids = [e[0] for e in entries]
    if not ids or len(set(ids)) != len(ids):
        raise StoreError("a segment must hold at least one tree and no tree id twice")
    return entries


def lock_store(root: Path) -> int:
    """An exclusive flock on root/LOCK (released by the kernel when the process dies); returns the fd."""
    fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        os.close(fd)
        raise StoreError(f"{root}: already open for writing by another handle") from e
    return fd


class SegmentCache:
    """LRU of memory-mapped segments; `table(locs)` slices them without copying, adjacent rows coalesced."""

    def __init__(self, path_of: Callable[[int], Path], size: int = 64):
        self._path_of, self._size = path_of, size
        self._open: OrderedDict[int, list[pa.RecordBatch]] = OrderedDict()

    def batches(self, seq: int) -> list[pa.RecordBatch]:
        if seq in self._open:
            self._open.move_to_end(seq)
            return self._open[seq]
        batches = self._open[seq] = read_segment(self._path_of(seq))[1]
        if len(self._open) > self._size:
            self._open.popitem(last=False)  # views already handed out keep their mapping alive
        return batches

    def table(self, locs: list[Loc]) -> pa.Table:
        runs: list[list[int]] = []
        for loc in locs:
            last = runs[-1] if runs else None
            if last and last[:2] == [loc.seq, loc.batch] and last[3] == loc.row0:
                last[3] = loc.row1
            else:
                runs.append([loc.seq, loc.batch, loc.row0, loc.row1])
        parts = [_as_schema(self.batches(s)[b].slice(r0, r1 - r0)) for s, b, r0, r1 in runs]
        return pa.Table.from_batches(parts, schema=SCHEMA)

    def clear(self) -> None:
        self._open.clear()
