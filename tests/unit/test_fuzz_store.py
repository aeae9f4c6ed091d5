"""Fuzzed store segments: byte flips and truncations of a committed segment file (storage/replay_store.py,
storage/tree_checks.py). Whatever the damage, opening the store never raises; a segment whose damage is
detected is reported (a writable open moves it to quarantine/ with a reason file) and none of its trees is
ever read; one whose damage is not detected (segments carry no checksum: a flipped token id or log-prob
can still make a valid tree) serves only trees that pass every rule of `validate_tree`.

2,000 derandomized cases for the read-only open (the report, nothing moved), 300 for the writable open
(the move), 2,000 for IPC bytes a client sends to `put_raw`. Pure files, no Ray: a few seconds each.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.replay_store import ReplayStore
from storage.store_files import BAD_SEGMENT, StoreError
from storage.tree_codec import encode_ipc
from system.tree import validate_tree
from tests.store_writer import credited, make_tree

RAW = encode_ipc([make_tree(i) for i in range(3)])  # 3 trees, 1-6 turns each: a few KiB
CREDITED = encode_ipc([credited(make_tree(i)) for i in range(3, 5)])
SEGMENTS = {"raw": RAW, "credited": CREDITED}
REJECTED = (*BAD_SEGMENT, StoreError, ValueError)  # what put_raw may raise for bad bytes (nothing else)


@st.composite
def damaged(draw):
    """(kind, damaged bytes, truncated?): 1-4 flipped bytes, a truncation, or both."""
    kind = draw(st.sampled_from(sorted(SEGMENTS)))
    data = bytearray(SEGMENTS[kind])
    how = draw(st.sampled_from(["flip", "truncate", "both"]))
    if how in ("truncate", "both"):
        data = data[: draw(st.integers(0, len(data) - 1))]
    n = len(data)
    for _ in range(draw(st.integers(1, 4)) if how != "truncate" and n else 0):
        # anywhere, or in the schema and footer (the first and last KiB), where one byte is structure
        at = draw(
            st.one_of(
                st.integers(0, n - 1), st.integers(0, min(n, 1024) - 1), st.integers(max(0, n - 1024), n - 1)
            )
        )
        data[at] ^= draw(st.integers(1, 255))
    return kind, bytes(data), how != "flip"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder in memory (/dev/shm) where there is one: thousands of directory operations and fsyncs
    take seconds on a disk, milliseconds there."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    folder = Path(tempfile.mkdtemp(prefix="treeopsd-fuzz-", dir=shm or tmp_path_factory.getbasetemp()))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def empty_store(scratch) -> Path:
    root = scratch / "store"
    ReplayStore(root).close()  # marker, segments/, quarantine/
    return root


def place(root: Path, kind: str, data: bytes) -> Path:
    """The store at `root` holding exactly one segment, `data`, as committed segment 1."""
    for sub in ("segments", "quarantine"):
        for p in (root / sub).iterdir():
            p.unlink()
    (root / "consumed.log").unlink(missing_ok=True)
    path = root / "segments" / f"000000000001.{kind}.arrow"
    path.write_bytes(data)
    return path


def assert_served_trees_are_valid(store: ReplayStore) -> int:
    ids = store.tree_ids()
    for tree in store.get_trees(ids):  # decodes every served tree ...
        validate_tree(tree)  # ... and each one passes every rule
    return len(ids)


@settings(max_examples=2000, deadline=None)
@given(damaged())
def test_a_damaged_segment_is_reported_and_never_read_or_serves_only_valid_trees(empty_store, case):
    kind, data, truncated = case
    path = place(empty_store, kind, data)
    with ReplayStore(empty_store, create=False, readonly=True) as store:  # never raises
        report = store.recovery_report
        if report:
            assert [(r["file"], r["committed"], r["moved_to"]) for r in report] == [(str(path), True, None)]
            assert store.tree_ids() == [] and store.stats()["trees"]["total"] == 0  # nothing of it is read
        else:
            assert not truncated  # an Arrow IPC file ends with its footer and magic: any cut is caught
            assert assert_served_trees_are_valid(store) >= 1
    assert path.read_bytes() == data  # a read-only open moves nothing


@settings(max_examples=300, deadline=None)
@given(damaged())
def test_a_writable_open_moves_a_damaged_segment_to_quarantine(empty_store, case):
    kind, data, truncated = case
    path = place(empty_store, kind, data)
    with ReplayStore(empty_store, create=False) as store:
        if store.recovery_report:
            moved = Path(store.recovery_report[0]["moved_to"])
            assert not path.exists() and moved.read_bytes() == data  # kept byte for byte, never deleted
            assert moved.with_name(moved.name + ".reason.json").is_file()
            assert store.tree_ids() == []
        else:
            assert not truncated and path.read_bytes() == data
            assert_served_trees_are_valid(store)


@settings(max_examples=2000, deadline=None)
@given(damaged())
def test_damaged_ipc_bytes_from_a_client_are_refused_or_commit_valid_trees(scratch, case):
    kind, data, truncated = case
    root = Path(tempfile.mkdtemp(dir=scratch)) / "store"
    with ReplayStore(root) as store:
        put = store.put_raw if kind == "raw" else store.put_credited
        try:
            put(data)
        except REJECTED:
            assert store.tree_ids() == [] and list((root / "segments").iterdir()) == []  # nothing written
        else:
            assert not truncated
            assert assert_served_trees_are_valid(store) >= 1
        store.put_raw([make_tree(99)])  # the store goes on working after a refused commit
        assert "t99" in store.tree_ids()
    shutil.rmtree(root.parent)


def test_the_fixture_segments_are_valid_to_begin_with(empty_store):
    place(empty_store, "raw", RAW)
    with ReplayStore(empty_store, create=False, readonly=True) as store:
        assert store.recovery_report == [] and store.tree_ids() == ["t0", "t1", "t2"]
        assert [t.equals(make_tree(i)) for i, t in enumerate(store.get_trees(store.tree_ids()))] == [True] * 3
    assert np.frombuffer(RAW[:6], np.uint8).tobytes() == b"ARROW1"
