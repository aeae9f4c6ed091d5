"""A second process reads the replay store while writers commit and are SIGKILLed: never half a commit.

README: "a commit that returned is on disk; a reader never sees half a commit; a commit killed before its
rename leaves a temp file that the next open quarantines". Here a reader child (tests/store_writer.py read)
reopens the store read-only in a loop, across the kills, while writer children (tests/store_writer.py write)
commit 1-3 trees per commit and the parent SIGKILLs them at seeded random moments (and three times at exact
points of a commit: torn temp file, before the rename, after it). It proves:
    every poll           each visible tree is exactly make_tree(i); the visible set only grows; a read-only
                         open reports nothing but temp files and moves nothing (checked in the reader)
    whole commits        at every poll each commit's ids are all visible or none: they first appear together
    acknowledged ⇒ seen  every id the writer printed "ok" for is visible to the reader's last poll
    seen ⇒ started       no visible id without a "begin" line of its commit
    live reads           in 4 rounds the reader sees the writer's first acknowledged commit while that
                         writer still runs and commits (the kill waits for it)
    recovery             a writable reopen quarantines only temp files (never a segment); verify_store is ok
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

from storage import store_files as sf
from storage.replay_store import ReplayStore
from storage.store_verify import verify_store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_store_crash import ROOT, WRITER, _outcome, _writer
from waiting import wait_until

RANDOM_KILLS = 12
LIVE_ROUNDS = 4  # random kills that first wait for the reader to see the live writer's commit
EXACT = ["torn_tmp", "before_rename", "after_rename"]  # the writer kills itself there (store_writer._arm)
READER_MAX_S = 150  # the reader stops by itself after this, should the parent never close its stdin


class Reader:
    """The reader child, its stdout drained by a thread into `polls` (new ids per poll) and `errors`."""

    def __init__(self, d: Path):
        args = [sys.executable, str(WRITER), "read", str(d), str(READER_MAX_S)]
        self.child = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        assert self.child.stdout.readline().strip() == "ready"
        self.polls: list[tuple[int, list[int]]] = []  # (temp files reported, ids new at this poll)
        self.errors: list[str] = []
        self.done = False
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        for line in self.child.stdout:
            word, *rest = line.split()
            if word == "poll":
                self.polls.append((int(rest[1]), [int(i) for i in rest[2:]]))
            elif word == "done":
                self.done = True
            else:
                self.errors.append(line.strip())

    def seen(self) -> set[int]:
        """Every id some poll has reported so far."""
        return {i for _, new in list(self.polls) for i in new}

    def wait_fresh_poll(self) -> None:
        """Until a poll that began after now has finished (the one in flight may have begun before)."""
        n = len(self.polls)
        wait_until(lambda: len(self.polls) >= n + 2 or self.child.poll() is not None, timeout_s=30)
        assert self.child.poll() is None, f"reader exited early: {self.errors[-3:]}"

    def finish(self) -> None:
        """Closes its stdin: it polls once more (after every kill), prints "done" and exits."""
        self.child.stdin.close()
        assert self.child.wait(timeout=60) == 0
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


def _round(
    d: Path, first: int, die_at: str | None, rng: random.Random, reader: Reader | None = None
) -> tuple[str, set[int], int, bool]:
    """A writer from id `first` dies (at `die_at`, or killed at a random moment): (its output, acknowledged
    ids, highest id begun, whether the reader saw it live). Given a `reader`, the kill waits until the
    reader has seen the writer's first acknowledged commit while the writer still runs and commits."""
    child = _writer(d, first, die_at)
    head, live = "", False
    if die_at is None:
        head = child.stdout.readline()  # the first "begin": aim the kill at commits, not at start-up
        if reader is not None:
            while not head.splitlines()[-1].startswith("ok"):
                head += child.stdout.readline()
            ids = {int(i) for i in head.splitlines()[-1].split()[1:]}
            wait_until(lambda: ids <= reader.seen() or child.poll() is not None, timeout_s=30)
            live = child.poll() is None and ids <= reader.seen()
        # a random moment to kill at (not a wait for anything): at once, inside a commit, or commits later
        time.sleep(rng.choice([0.0, rng.uniform(0.0, 0.003), rng.uniform(0.0, 0.03), rng.uniform(0, 0.2)]))
        child.kill()
    child.wait(timeout=30)  # an armed writer kills itself inside its 2nd commit
    out = head + child.stdout.read()
    acked, _, top = _outcome(child, out)  # asserts the SIGKILL; its own read() finds the pipe at EOF
    return out, acked, top, live


def _commits(out: str) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in line.split()[1:]) for line in out.splitlines() if line.startswith("begin")]


def _check_whole_commits(reader: Reader, begun: list[tuple[int, ...]], acked: set[int]) -> set[int]:
    """The reader's view against the writers' output; returns the ids it saw."""
    first_seen: dict[int, int] = {}
    for k, (_, new) in enumerate(reader.polls):
        for i in new:
            assert i not in first_seen, f"t{i} reported new twice (polls {first_seen[i]} and {k})"
            first_seen[i] = k
    seen = set(first_seen)
    for ids in begun:  # all ids of a commit appear at the same poll, or none ever do
        at = {first_seen.get(i) for i in ids}
        assert len(at) == 1, f"commit {ids} was partly visible: first seen at polls {at}"
    started = {i for ids in begun for i in ids}
    assert seen <= started, f"visible although its commit never began: {sorted(seen - started)[:5]}"
    assert acked <= seen, f"acknowledged but never visible to the reader: {sorted(acked - seen)[:5]}"
    return seen


def _check_recovery(d: Path, seen: set[int]) -> int:
    """A writable reopen keeps every tree seen and quarantines only temp files; returns how many it moved."""
    with ReplayStore(d) as store:
        assert {int(t[1:]) for t in store.tree_ids()} == seen
        report = store.recovery_report
    for entry in report:
        assert not entry["committed"] and "uncommitted temp file" in entry["reason"], entry
        assert Path(entry["moved_to"]).parent == d / "quarantine"
    moved = sf.quarantined_files(d)
    assert all(p.name.startswith("tmp-") for p in moved), [p.name for p in moved]  # never a segment
    result = verify_store(d)
    assert result.ok, result.errors
    assert not result.notes  # the reopen left no temp file behind
    return len(moved)


def test_reader_never_sees_half_a_commit_while_writers_are_killed(tmp_path):
    rng = random.Random(20240611)
    plan: list[str | None] = [None] * RANDOM_KILLS + EXACT
    rng.shuffle(plan)
    d, next_id, reader = tmp_path / "s", 0, None
    begun: list[tuple[int, ...]] = []
    acked: set[int] = set()
    lives: list[bool] = []  # per round whose kill waited for the reader
    started = time.monotonic()
    try:
        for die_at in plan:
            # the first LIVE_ROUNDS random kills wait until the reader saw the live writer's first commit
            watch = reader if die_at is None and len(lives) < LIVE_ROUNDS else None
            out, acked_now, top, live = _round(d, next_id, die_at, rng, watch)
            begun, acked, next_id = begun + _commits(out), acked | acked_now, max(next_id, top + 1)
            lives += [live] if watch else []
            reader = reader or Reader(d)  # the first writer created the store
            reader.wait_fresh_poll()  # the reader polls the store the kill left, before the next writer
        reader.finish()
    finally:
        if reader is not None and reader.child.poll() is None:
            reader.child.kill()
    assert not reader.errors and reader.done, reader.errors[:5]
    seen = _check_whole_commits(reader, begun, acked)
    with_temp = sum(1 for temp, _ in reader.polls if temp)
    assert with_temp >= 2, "the reader never polled while a killed commit's temp file was on disk"
    with_news = sum(1 for _, new in reader.polls if new)
    # a reader polling beside a live writer sees each commit it acknowledged (not only after its death)
    assert len(lives) == LIVE_ROUNDS and all(lives), (
        f"rounds whose reader saw their live writer's commit: {lives}"
    )
    moved = _check_recovery(d, seen)
    print(
        f"{len(plan)} kills in {time.monotonic() - started:.1f} s: {len(reader.polls)} polls "
        f"({with_temp} with a temp file, {with_news} with new trees), {len(begun)} commits begun, "
        f"{len(acked)} ids acknowledged, {len(seen)} seen, {moved} temp files quarantined"
    )
