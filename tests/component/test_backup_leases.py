"""Backup leases come back: a killed backup actor's trees are leased again and crediting is idempotent.

Proves README "What happens when a role dies" ("A killed backup actor is replaced; its leased trees come back
and crediting is idempotent") against storage/replay_store.py's contract: `lease_raw` leases uncredited
trees to one backup for `lease_s` seconds, in memory; they come back when the lease expires, on
`release_raw`, or on reopen; a later credited copy replaces the earlier one and keeps its queue position, so
the learner gets every tree exactly once, with the credit `credit_rollout_tree` computes (a pure function).

Time is a fake clock patched into `storage.replay_store.time`: expiry is exact and instant, never slept for.
"""

from __future__ import annotations

from collections import Counter

import pytest
from store_writer import make_tree
from test_replay_store import fill

from actors.backup_worker import BackupWorker
from configs.schema import AlgoConfig
from storage import replay_store
from storage.replay_store import ReplayStore
from system.credit import credit_rollout_tree
from system.tree import RolloutTree

LEASE_S = 30.0
T0 = 1000.0  # fake monotonic time at which backup A takes its lease; its lease ends at T0 + LEASE_S = 1030.0


class FakeClock:
    """Stands in for the `time` module inside storage/replay_store.py, which only calls time.monotonic()."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock(T0)
    monkeypatch.setattr(replay_store, "time", fake)
    return fake


def ids(trees: list[RolloutTree]) -> list[str]:
    return [t.tree_id for t in trees]


def leased(store: ReplayStore) -> int:
    return store.stats()["trees"]["leased"]


def test_expired_lease_gives_the_trees_back(tmp_path, clock):
    with ReplayStore(tmp_path / "s", lease_s=LEASE_S) as store:
        fill(store, range(0, 3), credit=False)
        fill(store, range(3, 6), credit=False)  # raw commit order t0..t5
        a = store.lease_raw(3)  # backup A, lease until 1030.0
        assert ids(a) == ["t0", "t1", "t2"]
        assert leased(store) == 3 and store.stats()["trees"]["raw"] == 6
        clock.now = T0 + 10.0
        b = store.lease_raw(10)  # backup B, lease until 1010.0 + 30.0 = 1040.0
        assert ids(b) == ["t3", "t4", "t5"]  # only the others, none of A's
        assert leased(store) == 6
        clock.now = T0 + LEASE_S - 0.5  # 1029.5: A's lease still holds
        assert store.lease_raw(10) == [] and leased(store) == 6
        clock.now = T0 + LEASE_S  # 1030.0: A's lease has run out (expiry = T0 + lease_s, inclusive)
        assert leased(store) == 3  # B's 3 trees, leased until 1040.0
        back = store.lease_raw(10)
        assert ids(back) == ["t0", "t1", "t2"]  # A's trees, in raw commit order, and only those
        assert all(t.equals(make_tree(i)) for i, t in enumerate(back))  # the raw trees as committed
        assert leased(store) == 6  # re-leased until 1030.0 + 30.0 = 1060.0
        assert store.lease_raw(10) == []
        clock.now = T0 + 2 * LEASE_S  # 1060.0: both leases (1040.0, 1060.0) have run out
        assert leased(store) == 0
        assert ids(store.lease_raw(4)) == ["t0", "t1", "t2", "t3"]  # raw commit order again
        assert store.stats()["trees"]["credited"] == 0


def test_reopen_gives_leased_trees_back(tmp_path, clock):
    with ReplayStore(tmp_path / "s", lease_s=LEASE_S) as store:
        fill(store, range(0, 4), credit=False)
        assert ids(store.lease_raw(3)) == ["t0", "t1", "t2"]
        assert ids(store.lease_raw(10)) == ["t3"]
        assert store.lease_raw(10) == [] and leased(store) == 4
    # the clock has not moved: had the leases been persisted, nothing would be leasable now
    with ReplayStore(tmp_path / "s", lease_s=LEASE_S) as store:
        stats = store.stats()
        assert stats["trees"] == {"raw": 4, "leased": 0, "credited": 0, "consumed": 0, "total": 4}
        assert stats["quarantined"] == 0 and store.recovery_report == []
        again = store.lease_raw(10)
        assert ids(again) == ["t0", "t1", "t2", "t3"]
        assert all(t.equals(make_tree(i)) for i, t in enumerate(again))
        assert leased(store) == 4 and store.lease_raw(10) == []


def test_release_raw_gives_trees_back_at_once(tmp_path, clock):
    with ReplayStore(tmp_path / "s", lease_s=LEASE_S) as store:
        fill(store, range(0, 5), credit=False)
        assert ids(store.lease_raw(4)) == ["t0", "t1", "t2", "t3"]
        assert leased(store) == 4
        store.release_raw(["t3", "t1"])  # the clock never moves: no lease has expired
        assert leased(store) == 2  # t0, t2 still leased
        assert ids(store.lease_raw(10)) == ["t1", "t3", "t4"]  # released ones in raw order, then t4
        assert leased(store) == 5 and store.lease_raw(10) == []
        store.release_raw(["t9"])  # an id that was never leased is a no-op
        assert leased(store) == 5 and store.lease_raw(10) == []


def credit_of(tree: RolloutTree) -> tuple[bytes, bytes, bytes, float | None]:
    c = tree.credit
    assert c is not None
    return c.z.tobytes(), c.V.tobytes(), c.q.tobytes(), c.tau


@pytest.mark.parametrize("comeback", ["expiry", "reopen"])
def test_crashed_backup_is_replaced_and_credit_is_idempotent(tmp_path, clock, comeback):
    algo = AlgoConfig()
    path = tmp_path / "s"
    store = ReplayStore(path, lease_s=LEASE_S)
    try:
        fill(store, range(0, 6), credit=False)
        dead = store.lease_raw(4)  # backup A leases t0..t3, credits them in memory, dies before committing
        late = [credit_rollout_tree(t, algo) for t in dead]
        assert ids(dead) == ["t0", "t1", "t2", "t3"]
        b = BackupWorker(store, algo)  # the replacement backup
        assert b.run_once(max_trees=64) == 2  # only t4, t5: A's lease holds
        assert b.run_once(max_trees=64) == 0
        if comeback == "expiry":
            clock.now = T0 + LEASE_S  # 1030.0: A's lease ends
        else:
            store.close()
            store = ReplayStore(path, lease_s=LEASE_S)  # the clock stays at T0: only the reopen frees them
            b = BackupWorker(store, algo)
        assert store.stats()["trees"]["leased"] == 0
        assert b.run_once(max_trees=64) == 4  # A's trees come back to B
        assert store.tree_ids("credited") == ["t4", "t5", "t0", "t1", "t2", "t3"]  # credit order
        store.put_credited(late[::-1])  # A's late duplicate, after B's, in another order
        stats = store.stats()["trees"]
        assert stats == {"raw": 0, "leased": 0, "credited": 6, "consumed": 0, "total": 6}
        assert store.tree_ids("credited") == ["t4", "t5", "t0", "t1", "t2", "t3"]  # positions kept
        batches = [store.take_batch(2) for _ in range(3)]
        assert store.take_batch(1) is None  # 6 credited trees = 3 batches of 2, nothing more
        taken = [t for batch in batches for t in batch]
        assert [ids(batch) for batch in batches] == [["t4", "t5"], ["t0", "t1"], ["t2", "t3"]]
        assert Counter(ids(taken)) == Counter(f"t{i}" for i in range(6))  # each exactly once
        for t in taken:
            fresh = credit_rollout_tree(make_tree(int(t.tree_id[1:])), algo)
            assert credit_of(t) == credit_of(fresh)  # byte-identical credit: a pure function
            assert t.equals(fresh)
        store.put_credited(late[:1])  # a duplicate of consumed t0 does not queue it again
        assert store.take_batch(1) is None
        assert store.stats()["trees"] == {"raw": 0, "leased": 0, "credited": 0, "consumed": 6, "total": 6}
    finally:
        store.close()
    with ReplayStore(path, lease_s=LEASE_S) as store:  # the same after a rescan of every segment
        assert store.take_batch(1) is None and store.tree_ids("consumed") == [f"t{i}" for i in range(6)]
        assert store.stats()["quarantined"] == 0
