"""The fire drill through the CLI (`treeopsd drill`, launch/cmd_drill.py): `treeopsd train --steps 12` as a
child process, a sampler, the backup, the store and the learner each SIGKILLed once at random steps, and the
run reaches step 12 by itself, exits 0, `treeopsd store verify` is clean, and every batch index is trained
exactly once — read from the learner's metrics (tensorboard) and the store's consumed log."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli_runs import ROOT, run_small

pytestmark = [pytest.mark.ray, pytest.mark.slow]
STEPS = 12  # kills in steps 1-6, then 6 steps to heal before the end


def test_train_reaches_its_steps_with_every_role_killed_once(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "drill"
    done = run_small(
        "drill",
        "--steps",
        str(STEPS),
        "--seed",
        "1",
        "--run-dir",
        str(run_dir),
        "--timeout-min",
        "15",
        model_dir=tiny_model_dir,
    )
    report = json.loads((run_dir / "drill.json").read_text())
    assert done.returncode == 0 and report["ok"], (report.get("checks"), done.stderr[-3000:])
    assert sorted(r for _, r, _ in report["kills"]) == ["backup", "learner", "sampler", "store"]
    assert [s for s, _, _ in report["kills"]] == [s for s, _ in report["plan"]]
    assert report["steps_trained"] == STEPS and report["store_batches"] == STEPS
    restarts = report["restarts"]
    assert (restarts["backup"], restarts["store"], restarts["learner"]) == (1, 1, 1)
    # The store's restart costs no sampler a restart (actors/tree_sampler.py returns from a call the store
    # could not answer): at most the killed one is counted. Not always even that one: a learner restarted
    # on a new weight port (the old one still held) replaces the samplers, and the new ones have no restarts.
    assert restarts["sampler"] <= 1
    assert report["store_verify"][0].startswith("ok: ")


def test_a_bad_override_is_refused_before_training_starts(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "drill",
        "--steps",
        "12",
        "--run-dir",
        str(tmp_path / "d"),
        "learner.no_such_key=1",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "learner.no_such_key" in done.stderr
    assert not (tmp_path / "d").exists()  # nothing started, nothing written
