"""Bad configuration through the user-facing path: `treeopsd train ...` exits 2 with one line naming the
dotted key and what it allows, before anything starts (no run directory, no Ray, no model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learner.checkpoint_every=0", "learner.checkpoint_every = 0 is invalid: expected an integer >= 1"),
        ("algo.rho=0.7", "algo.rho = 0.7 is invalid: expected a number in the open interval (0, 1/2)"),
        ("sampler.backend=tgi", "sampler.backend = 'tgi' is invalid: allowed values are 'hf', 'vllm'"),
        ("env.token_budget=0", "env.token_budget = 0 is invalid: expected an integer >= 1"),
    ],
)
def test_train_rejects_a_bad_value_before_anything_starts(tmp_path, override, message):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.cli", "train", "--run-dir", str(run_dir), override]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"treeopsd train: {message}"  # one line, no traceback
    assert not run_dir.exists()  # nothing was prepared, let alone started


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # a geometric-mean weight is no likelihood ratio of anything: refused for TreeOPSD's turns
            ["algo.rollout_correction=geo_tis"],
            "algo.rollout_correction = 'geo_tis' is invalid: expected none, token_tis, prod_tis, prod_mis or "
            "tr_mask with algo.method = treeopsd (geometric-mean and token-band weights are biased on turns "
            "of more than one token)",
        ),
        (  # a trust region on π_prox with μ's samples uncorrected
            ["algo.method=grpo", "algo.proximal=step_start", "algo.rollout_correction=none"],
            "algo.rollout_correction = 'none' is invalid: expected a correction with algo.proximal = "
            "step_start and algo.method = grpo, or algo.proximal = behavior",
        ),
        (  # the old name of the geometric mean
            ["algo.method=grpo", "algo.rollout_correction=seq_is"],
            "algo.rollout_correction = 'seq_is' is invalid: allowed values are 'auto', 'none', 'token_tis', "
            "'token_mask', 'geo_tis', 'geo_mask', 'prod_tis', 'prod_mis', 'tr_mask'",
        ),
    ],
)
def test_train_refuses_a_wrong_offpolicy_combination_with_one_line(tmp_path, overrides, message):
    # Today's code accepted the first two (and named seq_is a sequence weight while it is a geometric mean).
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.cli", "train", "--run-dir", str(run_dir), *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"treeopsd train: {message}"
    assert not run_dir.exists()


def test_train_never_reaches_ray_with_a_bad_config(monkeypatch, tmp_path, capsys):
    import runtime.ray_run
    from launch.cli import main

    def forbidden(*args, **kwargs):
        raise AssertionError("Ray was started for a config that fails validation")

    monkeypatch.setattr(runtime.ray_run, "ray_training", forbidden)  # what `treeopsd train` enters
    assert main(["train", "--run-dir", str(tmp_path / "r"), "learner.epochs=0"]) == 2
    assert "learner.epochs = 0 is invalid: expected an integer >= 1" in capsys.readouterr().err
