"""`treeopsd` subcommands run as a child process on a small run of the tiny model (local Ray: RAY_ADDRESS is
dropped, so the child starts its own instance and kills by pid stay inside it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL_RUN = (
    "learner.batch_trees=2",
    "learner.minibatches=2",
    "algo.M=2",
    "algo.N=1",
    "env.max_turns=3",
    "env.max_turn_tokens=16",
)


def run_small(*args: str, model_dir: str, timeout_s: float = 1200) -> subprocess.CompletedProcess[str]:
    """`treeopsd ARGS model.path=MODEL_DIR SMALL_RUN...`, its output captured."""
    cmd = [sys.executable, "-m", "launch.cli", *args, f"model.path={model_dir}", *SMALL_RUN]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
