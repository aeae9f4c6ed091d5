"""`treeopsd train` with the example harness (issue 40): the samplers grow their trees through the agent
endpoint on local Ray (tiny model), 3 steps, then `--resume` trains one more; the store verifies."""

from __future__ import annotations

import json

import pytest

from storage.metrics import read_scalars
from storage.store_verify import verify_store
from tests.cli_runs import run_small

pytestmark = [pytest.mark.ray, pytest.mark.slow]
HARNESS = ("env.harness=examples.search_agent:run_episode", "env.protocol=qwen3", "sampler.num_samplers=1")


def test_train_with_the_example_harness_runs_and_resumes(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    args = ("--run-dir", str(run_dir), "--no-progress", *HARNESS)
    done = run_small("train", "--steps", "3", *args, model_dir=tiny_model_dir, timeout_s=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    scalars = read_scalars(run_dir / "tb")
    # every trained tree came through the endpoint: B = 2 trees of M = 2 episodes per step at least
    assert max(v for _, v in scalars["external/episodes_stored"]) >= 3 * 2 * 2
    resumed = run_small("train", "--resume", "--steps", "4", *args, model_dir=tiny_model_dir, timeout_s=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["steps_this_run"]) == (4, 1)
    assert verify_store(run_dir / "store").ok
