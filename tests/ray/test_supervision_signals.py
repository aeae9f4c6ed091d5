"""Ctrl-C of `treeopsd train` (runtime/signals.py), as a user sees it: the command started as its own process
group on the tiny model, SIGINT to the whole group once the first checkpoint is there (a terminal's Ctrl-C
reaches every process of the foreground group) → exit 0, the step reached and the resume command printed, a
checkpoint of that step; `--resume` then trains the remaining batches, each once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_until

from faults.audit import audit_store
from storage.checkpoint import load_latest
from storage.metrics import read_scalars

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
STEPS, B = 6, 2


def train_cmd(run_dir: Path, model: str, *extra: str) -> list[str]:
    small = [
        f"model.path={model}",
        f"learner.batch_trees={B}",
        "learner.minibatches=2",
        "sampler.num_samplers=1",  # what is tested is the driver's signal path: one sampler's CPU less
        "algo.M=2",
        "algo.N=1",
        "env.max_turns=3",
        "env.max_turn_tokens=16",
        "store.eta=1",
    ]
    return [
        sys.executable,
        "-m",
        "launch.cli",
        "train",
        "--steps",
        str(STEPS),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *extra,
        *small,
    ]


def test_ctrl_c_exits_0_with_a_checkpoint_and_resume_continues_at_the_next_batch(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        train_cmd(run_dir, tiny_model_dir),
        cwd=ROOT,
        env=env,
        start_new_session=True,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: (run_dir / "checkpoints" / "latest").exists() or proc.poll() is not None, 900, 0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    reached = summary["steps"]
    assert summary["stopped_by"] == "SIGINT" and 1 <= reached < STEPS
    assert f"stopped by SIGINT at step {reached} of {STEPS}" in err
    assert "continue with: treeopsd train --resume --steps 6 --run-dir" in err
    ckpt = load_latest(run_dir)
    assert ckpt is not None and ckpt.step == reached and ckpt.extra["watermark"] == reached

    resumed = subprocess.run(
        train_cmd(run_dir, tiny_model_dir, "--resume"),
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["steps"] == STEPS and again["steps_this_run"] == STEPS - reached
    batches = sorted(int(v) for _, v in read_scalars(run_dir / "tb")["learner/batch_index"])
    assert batches == list(range(STEPS))  # both runs together: every batch once, none skipped
    store = audit_store(run_dir / "store")
    assert store["batches"] == STEPS and store["trees_trained"] == STEPS * B
    assert (store["trees_lost"], store["trees_duplicated"]) == (0, 0)
