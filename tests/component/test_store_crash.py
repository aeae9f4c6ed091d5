"""Crash safety: a writer process SIGKILLed at random moments (≥50 times) and at exact points of a commit.

The child (tests/store_writer.py) prints "begin <ids>" before put_raw and "ok <ids>" after it returned. After
each kill the store is reopened (recovery) and must satisfy the contract in storage/replay_store.py:
    acknowledged ⇒ present      every id printed after "ok" is in the store
    present ⇒ started           an id not acknowledged may be present only if its commit was in flight
                                (the "begin" without "ok"), e.g. killed after the rename, before the print
    nothing lost                every tree present before the kill is still present, bit-identical
    torn ⇒ quarantined          a temp file left by the kill is moved to quarantine/, and only such files
and `treeopsd store verify` exits 0 (the function each round, the real command once at the end).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from storage import store_files as sf
from storage.replay_store import ReplayStore
from storage.store_verify import verify_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from store_writer import make_tree

ROOT = Path(__file__).resolve().parents[2]
WRITER = ROOT / "tests" / "store_writer.py"
RANDOM_KILLS = 50


def _writer(d: Path, first: int, die_at: str | None = None) -> subprocess.Popen:
    args = [sys.executable, str(WRITER), "write", str(d), str(first), *([die_at] if die_at else [])]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert child.stdout.readline().strip() == "ready"
    return child


def _outcome(child: subprocess.Popen, head: str) -> tuple[set[int], set[int], int]:
    """(acknowledged ids, ids of the commit in flight at death, highest id begun) from the child's output."""
    out = head + child.stdout.read()
    child.wait()
    assert child.returncode == -9, out[-500:]
    acked, in_flight, top = set(), set(), -1
    for line in out.splitlines():
        word, *ids = line.split()
        nums = {int(i) for i in ids}
        top = max(top, *nums)
        if word == "begin":
            in_flight = nums
        else:
            acked |= nums
            in_flight = set()
    return acked, in_flight, top


class Ledger:
    """What the parent knows: acknowledged ids so far and what the store held after the last check."""

    def __init__(self, d: Path):
        self.d, self.acked, self.present, self.next_id, self.torn = d, set(), set(), 0, 0

    def check(self, child: subprocess.Popen, head: str = "") -> tuple[set[int], list[dict]]:
        acked, in_flight, top = _outcome(child, head)
        self.acked |= acked
        self.next_id = max(self.next_id, top + 1)  # ids are never reused, even if their commit was lost
        with ReplayStore(self.d) as store:
            present = {int(t[1:]) for t in store.tree_ids()}
            report = store.recovery_report
            new = sorted(present - self.present)
            for tree in store.get_trees(f"t{i}" for i in new):
                i = int(tree.tree_id[1:])
                assert tree.equals(make_tree(i)) or tree.equals(make_tree(i, big=True)), tree.tree_id
        assert self.acked <= present, f"acknowledged but missing: {sorted(self.acked - present)}"
        assert present - self.acked <= self.present | in_flight, "present although its commit never started"
        assert self.present <= present, "a tree present before the kill was lost"
        for entry in report:  # only uncommitted temp files may be quarantined
            assert not entry["committed"] and "uncommitted temp file" in entry["reason"], entry
            assert Path(entry["moved_to"]).parent == self.d / "quarantine"
        self.present, self.torn = present, self.torn + len(report)
        assert len(sf.quarantined_files(self.d)) == self.torn
        result = verify_store(self.d)
        assert result.ok, result.errors
        return in_flight & present, report


@pytest.mark.parametrize(
    ("die_at", "in_flight_present", "torn"),
    [("torn_tmp", False, 1), ("before_rename", False, 1), ("after_rename", True, 0)],
)
def test_kill_at_exact_commit_points(tmp_path, die_at, in_flight_present, torn):
    ledger = Ledger(tmp_path / "s")
    child = _writer(ledger.d, 0, die_at)  # dies inside its 2nd commit
    landed, report = ledger.check(child)
    assert bool(landed) == in_flight_present and len(report) == torn
    assert len(ledger.acked) >= 1 and ledger.present - ledger.acked == landed


def test_random_sigkills_lose_nothing_acknowledged_and_add_nothing_unstarted(tmp_path):
    rng = np.random.default_rng(12345)
    ledger = Ledger(tmp_path / "s")
    landed = 0
    for _ in range(RANDOM_KILLS):
        child = _writer(ledger.d, ledger.next_id)
        head = child.stdout.readline()  # the first "begin": aim the kill at commits, not at start-up
        # a random moment to kill at (not a wait for anything): at once, inside a commit, or a few commits on
        time.sleep(rng.choice([0.0, rng.uniform(0.0, 0.003), rng.uniform(0.0, 0.03)]))
        child.kill()
        landed += len(ledger.check(child, head)[0])
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "store", "verify", str(ledger.d)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    print(
        f"{RANDOM_KILLS} kills: {len(ledger.acked)} acknowledged, {len(ledger.present)} present, "
        f"{landed} unacknowledged commits landed, {ledger.torn} temp files quarantined"
    )
