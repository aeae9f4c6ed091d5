"""The fault campaign both `treeopsd soak` and `treeopsd drill` run (faults/): the two kill schedules, the
audit over a run's own files (a real store and tensorboard events, written here), the memory figures, and the
role processes found through /proc (stand-ins titled like Ray's actor processes)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time

import pytest

from faults.audit import audit_run
from faults.campaign import AtSteps, EverySeconds
from faults.processes import ROLES, MemoryWatch, kill_role, role_processes
from storage.metrics import TensorboardSink
from storage.replay_store import ReplayStore
from tests.store_writer import credited, make_tree


def test_every_seconds_is_due_at_each_multiple_before_the_stop_and_passes_a_tick_with_no_victim():
    soak = EverySeconds(every_s=15, minutes=1, roles=ROLES, seed=0)
    assert soak.stop_at_s == 60 and soak.due(14.9, lambda: 0) is None  # the first tick is at 15 s
    at, roles = soak.due(15.34, lambda: 0)
    assert at == 15.3 and sorted(roles) == sorted(ROLES)  # every role, in a seeded random order
    soak.attempted(killed=False)  # no role had a process: the tick passes all the same
    assert soak.due(29.9, lambda: 0) is None and soak.due(30.0, lambda: 0)[0] == 30.0
    soak.attempted(killed=True)
    assert soak.due(45.0, lambda: 0)[0] == 45.0
    soak.attempted(killed=True)
    assert soak.due(61.0, lambda: 0) is None  # the tick at 60 s is the stop itself: 15, 30, 45 only
    late = EverySeconds(every_s=10, minutes=1, roles=ROLES, seed=0)
    assert late.due(31.0, lambda: 0)[0] == 31.0  # a poll late by 21 s: one kill, not the 3 of 10, 20, 30
    late.attempted(killed=True)
    assert late.due(39.9, lambda: 0) is None and late.due(40.0, lambda: 0)[0] == 40.0
    again = EverySeconds(every_s=15, minutes=1, roles=ROLES, seed=0)
    assert again.due(15.0, lambda: 0)[1] == roles  # the same seed, the same order


def test_at_steps_waits_for_the_batches_then_up_to_a_second_and_retries_a_role_that_is_down():
    drill = AtSteps([(2, "store"), (3, "learner")], seed=0)
    assert drill.stop_at_s is None  # the run ends by itself
    assert drill.due(10.0, lambda: 1) is None  # 1 batch handed out, the kill is after the 2nd
    assert drill.due(10.0, lambda: 2) in (None, (2, ["store"]))  # armed: due at 10 s + U(0, 1)
    assert drill.due(11.0, lambda: 2) == (2, ["store"])
    drill.attempted(killed=False)  # the store was restarting: tried again at the next poll
    assert drill.due(11.2, lambda: 2) == (2, ["store"])
    drill.attempted(killed=True)
    assert drill.due(11.4, lambda: 2) is None  # the learner's turn comes after the 3rd batch
    assert drill.due(12.0, lambda: 3) in (None, (3, ["learner"])) and drill.due(13.0, lambda: 3)
    drill.attempted(killed=True)
    assert drill.due(99.0, lambda: 9) is None  # the plan is done


def write_run(run_dir, steps_logged, batches, summary_steps):
    """A finished run's files: a store of 6 credited trees with `batches` batches of 2 handed out, the
    learner's (step, batch index) events in tensorboard, and summary.json."""
    with ReplayStore(run_dir / "store") as store:
        store.put_credited([credited(make_tree(i)) for i in range(6)])
        for _ in range(batches):
            store.take_batch_ids(2)
    sink = TensorboardSink(run_dir / "tb")
    for step, k in steps_logged:
        sink.log({"learner/batch_index": float(k)}, step)
    sink.close()
    summary = {"steps": summary_steps, "restarts": {"learner": 1}, "sampler_restarts": 2}
    (run_dir / "summary.json").write_text(json.dumps({**summary, "checkpoint": "ckpt/3"}))


def test_audit_reads_a_sound_run_from_its_files(tmp_path):
    # steps 1-3 trained batches 0-2; the learner restarted from the checkpoint of step 1 and logged steps 2
    # and 3 again: its lineage is {1: 0, 2: 1, 3: 2}, each of the store's 3 batches once
    write_run(tmp_path, [(1, 0), (2, 1), (3, 2), (2, 1), (3, 2)], batches=3, summary_steps=3)
    got = audit_run(tmp_path, None, 0, kills=[(15.0, "learner", 7)])  # the soak's: steps from summary
    assert got["ok"] and all(got["checks"].values()) and "each_role_killed_once" not in got["checks"]
    assert (got["steps"], got["steps_trained"], got["store_batches"]) == (3, 3, 3)
    assert got["batches_handed_out_not_trained"] == 0 and got["steps_without_metrics"] == []
    store = got["store"]  # 6 committed, 3 batches x 2 = 6 trained, none lost
    assert (store["trees_committed"], store["trees_trained"], store["batches"]) == (6, 6, 3)
    assert (store["trees_lost"], store["trees_duplicated"], store["trees_half_visible"]) == (0, 0, 0)
    assert got["store_verify"] == ["ok: 6 trees in 1 segments decode and validate"]  # one commit of 6
    assert got["restarts"] == {"learner": 1, "sampler": 2} and got["checkpoint"] == "ckpt/3"


def test_audit_names_what_a_broken_run_left(tmp_path):
    # the run says it reached step 4 but logged only steps 1-3, and the store handed out 3 batches: step 4
    # has no metrics, batch 3 was never trained, and 4 steps do not match 3 batches
    write_run(tmp_path, [(1, 0), (2, 1), (3, 2)], batches=3, summary_steps=4)
    plan = [(1, "store"), (2, "learner")]
    got = audit_run(tmp_path, 4, 1, plan=plan, kills=[(1, "store", 5)])  # the drill's: its --steps
    failed = [name for name, ok in got["checks"].items() if not ok]
    assert failed == [
        "exit_0",
        "each_role_killed_once",
        "reached_all_steps",
        "every_batch_trained_once",
        "store_batches_match",
    ]
    assert got["batches_skipped"] == [3] and got["steps_without_metrics"] == [4]
    assert got["batches_handed_out_not_trained"] == -1 and not got["ok"]


def test_audit_of_a_run_that_never_opened_its_store_says_so(tmp_path):
    got = audit_run(tmp_path, 5, 1)
    assert not got["ok"] and got["store"] is None and got["store_batches"] == 0
    assert got["checks"]["store_verify_clean"] is False and got["steps_without_metrics"] == [1, 2, 3, 4, 5]


def test_memory_report_measures_only_processes_watched_past_warm_up_and_window():
    watch = MemoryWatch(root_pid=os.getpid())
    # store 11: 100 MB at 120 s, 106 at 180, 112 at 240 (after a 120 s warm-up): 6 MB/min, lived 240 s
    watch.samples[("store", 11)] = [(0.0, 50e6), (120.0, 100e6), (180.0, 106e6), (240.0, 112e6)]
    # store 12 (the restarted one): lived 10 s, never past its warm-up: not measured
    watch.samples[("store", 12)] = [(300.0, 80e6), (310.0, 90e6)]
    report = watch.report(warmup_s=120.0, min_window_s=100.0)
    assert report == {
        "store": {
            "processes": 2,
            "measured": 1,
            "max_slope_mb_per_min": 6.0,
            "rss_mb": 112.0,
            "longest_lived_s": 240.0,
        }
    }
    assert watch.series_mb()["store/12"] == [[300.0, 80.0], [310.0, 90.0]]


@pytest.fixture
def stand_ins():
    """Two processes titled like Ray's actor processes (`exec -a` sets the title), children of this one."""
    procs = [
        subprocess.Popen(["bash", "-c", f"exec -a {title} sleep 60"])
        for title in ("ray::StoreActor", "ray::LearnerRankActor.step")
    ]
    time.sleep(0.3)  # exec done: the titles are in /proc
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_role_processes_are_found_by_title_under_the_root_and_killed_by_pid(stand_ins):
    store, rank = stand_ins
    found = role_processes(os.getpid())
    assert found["store"] == [store.pid] and found["learner"] == [rank.pid]  # a rank counts as the learner
    assert found["sampler"] == [] and found["backup"] == []
    assert role_processes(rank.pid)["store"] == []  # not under that root: never touched
    assert kill_role("sampler", random.Random(0), os.getpid()) is None
    assert kill_role("store", random.Random(0), os.getpid()) == store.pid
    assert store.wait(timeout=10) == -9  # SIGKILLed
