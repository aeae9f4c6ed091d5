"""ReplayStore: states, exactly-once batches across a SIGKILLed consumer, bad-file recovery, admission."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from launch import cli
from storage import store_files as sf
from storage.durable import write_atomic
from storage.replay_store import ReplayStore, StoreError
from storage.store_verify import verify_store
from storage.tree_codec import VERSION_KEY, encode_trees, flat_batches, table_to_ipc
from system.tree import RolloutTree, TreeValidationError, make_node

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from store_writer import credited, make_tree

ROOT = Path(__file__).resolve().parents[2]
WRITER = ROOT / "tests" / "store_writer.py"


def fill(store: ReplayStore, ids: range, credit: bool = True) -> list[RolloutTree]:
    trees = [make_tree(i) for i in ids]
    store.put_raw(trees)
    if credit:
        store.put_credited([credited(t) for t in trees])
    return trees


def test_states_lease_and_exactly_once(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        trees = fill(store, range(0, 3), credit=False) + fill(store, range(3, 6), credit=False)
        leased = store.lease_raw(4)
        assert [t.tree_id for t in leased] == ["t0", "t1", "t2", "t3"]  # raw commit order
        assert [t.tree_id for t in store.lease_raw(10)] == [
            "t4",
            "t5",
        ]  # leased ones are not handed out twice
        assert store.lease_raw(10) == []
        store.release_raw(["t5"])  # a backup gave one back
        assert [t.tree_id for t in store.lease_raw(10)] == ["t5"]
        store.put_credited([credited(t) for t in leased[:3]])
        assert store.stats()["trees"] == {"raw": 3, "leased": 3, "credited": 3, "consumed": 0, "total": 6}
        first = store.take_batch(2)
        assert [t.tree_id for t in first] == ["t0", "t1"] and first[0].equals(credited(trees[0]))
        assert store.take_batch(2) is None  # only t2 credited and unconsumed: no partial batch
        store.put_credited([credited(t) for t in trees[3:]])
        store.put_credited([credited(trees[2], tau=None)])  # re-credit: supersedes, keeps its queue place
        second = store.take_batch(2)
        assert [t.tree_id for t in second] == ["t2", "t3"] and second[0].credit.tau is None
        assert store.watermark() == 2 and store.batch_tree_ids(1) == ["t2", "t3"]
        stats = store.stats()
    assert stats["trees"] == {"raw": 0, "leased": 0, "credited": 2, "consumed": 4, "total": 6}
    assert stats["segments"] == {"raw": 2, "credited": 3, "total": 5} and stats["quarantined"] == 0
    with ReplayStore(tmp_path / "s") as store:  # durable: same state after reopen, leases gone
        assert store.tree_ids("consumed") == ["t0", "t1", "t2", "t3"]
        assert [t.tree_id for t in store.take_batch(2)] == ["t4", "t5"]
        assert store.take_batch(1) is None


def test_rewind_hands_out_the_same_batches_again(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        fill(store, range(8))
        batches = [store.take_batch_ids(2) for _ in range(3)]
        fill(store, range(8, 10))  # credited later: queued behind everything handed out
        assert store.rewind_to(1) == 4  # the learner's checkpoint says batches 0..0 were trained
    with ReplayStore(tmp_path / "s") as store:
        assert store.watermark() == 1
        assert [store.take_batch_ids(2) for _ in range(2)] == batches[1:]  # same composition, same ids
        assert store.take_batch_ids(2) == ["t6", "t7"]
        with pytest.raises(ValueError, match="outside"):
            store.rewind_to(9)


def _run_consumer(
    directory: Path, die_at: str | None = None, kill_after: int | None = None
) -> list[list[str]]:
    """Starts the consumer child; returns the batches it printed before dying (or finishing)."""
    args = [sys.executable, str(WRITER), "consume", str(directory), "3", *([die_at] if die_at else [])]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert child.stdout.readline().strip() == "ready"
    seen: list[list[str]] = []
    for line in child.stdout:
        if line.startswith("batch"):
            ids = line.split()[2:]  # "batch <k> <ids>"
            seen.append(ids)
            if kill_after is not None and len(seen) == kill_after:
                child.send_signal(signal.SIGKILL)
    child.wait()
    return seen


@pytest.mark.parametrize("die_at", ["after_log", "log_torn", None])
def test_sigkilled_consumer_resumes_without_loss_or_duplicate(tmp_path, die_at):
    d = tmp_path / "s"
    with ReplayStore(d) as store:
        fill(store, range(60))
    printed = _run_consumer(d, die_at, kill_after=None if die_at else 4)  # first run: killed
    with ReplayStore(d) as store:
        # the learner's checkpoint holds the batches it saw; a batch recorded but never seen is voided
        assert store.watermark() in (len(printed), len(printed) + 1)
        assert [store.batch_tree_ids(k) for k in range(len(printed))] == printed
        torn = [r for r in store.recovery_report if "torn" in r["reason"]]
        assert len(torn) == (die_at == "log_torn") and all(Path(r["moved_to"]).exists() for r in torn)
        store.rewind_to(len(printed))
    rest = _run_consumer(d)  # second run: to the end
    handed = [t for b in printed + rest for t in b]
    assert len(handed) == len(set(handed)) == 60  # no duplicate, nothing skipped
    assert set(handed) == {f"t{i}" for i in range(60)}


def _three_segments(d: Path) -> list[Path]:
    with ReplayStore(d) as store:
        for k in range(3):
            fill(store, range(3 * k, 3 * k + 3), credit=False)
    return sorted((d / "segments").glob("*.arrow"))


def _plant(d: Path, name: str, batch: pa.RecordBatch) -> Path:
    path = d / "segments" / name
    write_atomic(path, table_to_ipc(batch))
    return path


def _truncate(d: Path, segs: list[Path]) -> Path:
    os.truncate(segs[1], segs[1].stat().st_size // 2)  # a torn write that somehow got renamed
    return segs[1]


def _bad_magic(d: Path, segs: list[Path]) -> Path:
    segs[1].write_bytes(b"NOTARROW" * 64)
    return segs[1]


def _schema_999(d: Path, segs: list[Path]) -> Path:
    future = encode_trees([make_tree(50)]).replace_schema_metadata({VERSION_KEY: b"999"})
    return _plant(d, "000000000010.raw.arrow", future)


def _invalid_tree(d: Path, segs: list[Path]) -> Path:
    leaf_without_reward = RolloutTree("t51", (make_node(0, -1, 0), make_node(1, 0, 1, [1], [1], [-0.5])))
    return _plant(d, "000000000011.raw.arrow", encode_trees([leaf_without_reward]))


BAD_CASES = {
    "truncated": ("ArrowInvalid", _truncate),
    "bad_magic": ("ArrowInvalid", _bad_magic),
    "schema_999": ("unknown treeopsd schema version '999'", _schema_999),
    "invalid_tree": ("tree 't51' node 1: leaf without a finite reward", _invalid_tree),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_segment_is_named_quarantined_and_nothing_else_is_lost(tmp_path, case, capsys):
    d = tmp_path / "s"
    segs = _three_segments(d)
    reason, damage = BAD_CASES[case]
    bad = damage(d, segs)
    lost = {"t3", "t4", "t5"} if bad == segs[1] else set()
    result = verify_store(d)  # read-only first: names the file, moves nothing
    assert not result.ok and str(bad) in result.errors[0] and reason in result.errors[0]
    assert bad.exists() and not sf.quarantined_files(d)
    assert cli.main(["store", "verify", str(d)]) == 1 and str(bad) in capsys.readouterr().out
    with ReplayStore(d) as store:
        (entry,) = store.recovery_report
        assert entry["file"] == str(bad) and reason in entry["reason"] and entry["committed"]
        assert set(store.tree_ids()) == {f"t{i}" for i in range(9)} - lost
        assert store.stats()["quarantined"] == 1
    moved = Path(entry["moved_to"])
    assert moved.parent == d / "quarantine" and moved.exists() and not bad.exists()
    assert reason in json.loads(Path(f"{moved}.reason.json").read_text())["reason"]
    assert verify_store(d).ok  # the rest of the store is intact


def test_not_a_store_and_second_writer_are_refused(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError, match=re.escape(f"{junk}: not a treeopsd replay store")):
        ReplayStore(junk)
    assert (junk / "notes.txt").read_text() == "keep me" and sorted(os.listdir(junk)) == ["notes.txt"]
    assert not verify_store(junk).ok and str(junk) in verify_store(junk).errors[0]
    with pytest.raises(StoreError, match="no treeopsd replay store"):
        ReplayStore(tmp_path / "missing", create=False)
    with ReplayStore(tmp_path / "s"), pytest.raises(StoreError, match="already open"):
        ReplayStore(tmp_path / "s")
    (tmp_path / "s" / "treeopsd-store.json").write_text(
        '{"format": "treeopsd.replay_store", "layout_version": 7}'
    )
    with pytest.raises(StoreError, match="layout version 7"):
        ReplayStore(tmp_path / "s")


def test_invalid_or_duplicate_trees_never_reach_disk(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        fill(store, range(2), credit=False)
        bad = RolloutTree("bad", (make_node(0, -1, 0), make_node(1, 0, 1, [1], [1], [-0.5])))
        with pytest.raises(TreeValidationError, match="leaf without a finite reward"):
            store.put_raw([make_tree(7), bad])
        with pytest.raises(ValueError, match="already in the store"):
            store.put_raw([make_tree(1)])
        with pytest.raises(ValueError, match="needs a tree with credit"):
            store.put_credited([make_tree(0)])
        assert store.stats()["segments"]["total"] == 1 and store.tree_ids() == ["t0", "t1"]


def test_corrupt_log_middle_is_refused(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        fill(store, range(6))
        for _ in range(3):
            store.take_batch_ids(2)
    log = tmp_path / "s" / "consumed.log"
    lines = log.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b"t2", b"t9")
    log.write_bytes(b"\n".join(lines))
    with pytest.raises(StoreError, match="line 2 fails its checksum"):
        ReplayStore(tmp_path / "s")


def test_admission_arithmetic(tmp_path):
    with ReplayStore(tmp_path / "s", eta=1, batch_size=4) as store:
        assert store.admission_capacity() == 8  # (eta 1 + v 0 + 1) * B 4 - produced 0
        assert store.admit(5) == 5  # reserved 5 -> capacity 3
        fill(
            store, range(3), credit=False
        )  # 3 commits use up 3 reservations: produced = 3 trees + 2 reserved
        assert store.admission_capacity() == 3
        assert store.admit(10) == 3 and store.admit(1) == 0  # produced 8 = capacity's bound
        store.release(2)  # a sampler crashed holding 2 reservations
        assert store.admission_capacity() == 2
        store.set_learner_version(2)  # two learner steps later: (1 + 2 + 1) * 4 - 6 = 10
        assert store.admission_capacity() == 10
        assert store.admission_capacity(eta=0, batch_size=2) == (0 + 2 + 1) * 2 - 6
    with ReplayStore(tmp_path / "s", eta=1, batch_size=4) as store:  # reservations are not durable
        assert store.admission_capacity() == 8 - 3


def test_read_columns_is_zero_copy_and_cli_inspect(tmp_path, capsys):
    with ReplayStore(tmp_path / "s") as store:
        fill(store, range(6))
        before = pa.total_allocated_bytes()
        table = store.read_columns(["t1", "t2", "t4"])
        assert pa.total_allocated_bytes() == before  # slices of the memory-mapped files, no Arrow copy
        flats = flat_batches(table)
        assert [f.tree_ids for f in flats] == [["t1", "t2"], ["t4"]]  # adjacent rows coalesced
        store.take_batch(2)
    assert cli.main(["store", "inspect", str(tmp_path / "s"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (
        info["trees"]["consumed"] == 2 and info["trees"]["credited"] == 4 and info["segments"]["total"] == 2
    )
    assert info["leaves"] == sum(make_tree(i).num_leaves for i in range(6))
    assert cli.main(["store", "inspect", str(tmp_path / "s")]) == 0 and "tokens" in capsys.readouterr().out
