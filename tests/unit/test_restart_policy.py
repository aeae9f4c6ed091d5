"""The pure parts around the decisions: the restart backoff and the batch events (runtime/decisions.py,
faults/audit.py), the resume command (launch/cmd_train.py), the memory slope of the soak
(faults/processes.py)."""

from __future__ import annotations

import shlex

import pytest

from faults.audit import batch_audit, trained_batches
from faults.processes import rss_slope_mb_per_min
from launch.cmd_train import resume_command
from runtime.decisions import backoff_s, catch_up_events


def test_backoff_doubles_from_one_second_up_to_the_cap():
    assert [backoff_s(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff_s(3, base_s=0.5, cap_s=10) == 2.0  # 0.5 · 2²
    with pytest.raises(ValueError, match=r"^attempt counts from 1, got 0$"):
        backoff_s(0)


def test_a_rewind_undoes_the_batches_after_the_checkpoint():
    # trained 0,1,2; the learner restarts from the step-2 checkpoint (holds batches 0,1); 2,3 trained again
    events = [("trained", 0), ("trained", 1), ("trained", 2), ("rewind", 2), ("trained", 2), ("trained", 3)]
    assert trained_batches(events) == [0, 1, 2, 3]
    assert batch_audit(events, steps=4) == {"trained": 4, "twice": [], "skipped": [], "unlogged": []}


def test_the_audit_finds_batches_twice_skipped_and_unlogged():
    events = [("trained", 0), ("trained", 0), ("unlogged", 2), ("trained", 4)]
    assert batch_audit(events, steps=5) == {"trained": 4, "twice": [0], "skipped": [1, 3], "unlogged": [2]}
    with pytest.raises(ValueError, match="unknown batch event"):
        trained_batches([("trained", 0), ("lost", 1)])


def test_steps_whose_calls_failed_are_caught_up_logged_where_the_learner_kept_the_metrics():
    # the driver logged 5 steps; the learner is at version 7: batches 5 and 6 were trained, the calls lost
    assert catch_up_events(5, 7, kept_batch=None) == [("unlogged", 5), ("unlogged", 6)]
    # it kept step 7's metrics (batch 6): only batch 5 stays unlogged
    assert catch_up_events(5, 7, kept_batch=6) == [("unlogged", 5), ("trained", 6)]
    assert catch_up_events(6, 7, kept_batch=6) == [("trained", 6)]
    assert catch_up_events(7, 7, kept_batch=None) == []
    events = [*[("trained", k) for k in range(5)], *catch_up_events(5, 7, kept_batch=6), ("trained", 7)]
    assert batch_audit(events, steps=8) == {"trained": 8, "twice": [], "skipped": [], "unlogged": [5]}


def test_resume_command_repeats_the_arguments_with_resume():
    argv = ["train", "--steps", "300", "--run-dir", "runs/x y", "learner.lr=1e-4"]
    cmd = resume_command(argv, "runs/x y")
    assert shlex.split(cmd) == [
        "treeopsd",
        "train",
        "--resume",
        "--steps",
        "300",
        "--run-dir",
        "runs/x y",
        "learner.lr=1e-4",
    ]
    # no --run-dir given (the default from the config): it is added, and --resume is not repeated
    assert resume_command(["--resume", "--steps", "3"], "runs/default") == (
        "treeopsd train --resume --steps 3 --run-dir runs/default"
    )
    assert "--run-dir" not in resume_command(["run.run_dir=/tmp/r"], "/tmp/r")


def test_rss_slope_is_the_least_squares_slope_after_warm_up():
    # 10 MB at t=0 (warm-up, ignored), then 100 MB + 1 MB per 30 s: a slope of 2 MB/min
    samples = [(0.0, 10e6)] + [(60.0 + 30 * i, 100e6 + 1e6 * i) for i in range(5)]
    assert rss_slope_mb_per_min(samples, warmup_s=60) == pytest.approx(2.0)
    flat = [(float(t), 5e6) for t in range(60, 200, 10)]
    assert rss_slope_mb_per_min(flat, warmup_s=60) == 0.0
    assert rss_slope_mb_per_min(samples[:3], warmup_s=60) is None  # 2 points past the warm-up
