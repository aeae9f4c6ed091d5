"""Fixtures of the outside-environment tests (actors/envs/gym): a tiny model that ends its turns, the
environments' folders, and the Python the ecosystems that pin `openai<3` are installed in.

The random tiny model of `tiny_model_dir` almost never samples its end-of-turn token, so every episode would
end in one cut turn and no tree would have an anchor. `turn_taking_model_dir` is the same model after a few
SFT steps on the synthetic task's oracle turns: it writes `search: …` lines and ends each turn, which is all
a multi-turn tree of any environment needs (the environments here never see a sensible action anyway).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ENVS = HERE / "gym_envs"
ECOSYSTEMS_PYTHON = os.environ.get("TREEOPSD_ECOSYSTEMS_PYTHON") or str(
    Path(sys.prefix) / "ecosystems" / "bin" / "python"
)


def ecosystems_python() -> str:
    """The ecosystems' venv (launch/setup_venv.sh makes it: verifiers and openenv-core), or a skip."""
    if not Path(ECOSYSTEMS_PYTHON).exists():
        pytest.skip(f"needs the ecosystems venv at {ECOSYSTEMS_PYTHON} (launch/setup_venv.sh makes it)")
    return ECOSYSTEMS_PYTHON


def turn_taking_model(tmp_path_factory) -> str:
    """The tiny model after 40 SFT steps on 64 two-hop oracle trajectories (about 6 s on 2 cores), built
    once per test session (each test module's session fixture calls this; the folder is shared)."""
    folder = tmp_path_factory.getbasetemp() / "turn-taking-model"
    if (folder / "config.json").is_file():
        return str(folder)
    from actors.envs.synthetic_kb import SyntheticKBEnv, tokenizer_texts
    from actors.policy.tiny_model import build_tiny_model, build_tokenizer, save_pretrained
    from actors.policy.warmstart import oracle_examples, sft_train

    env = SyntheticKBEnv()
    tok = build_tokenizer(tokenizer_texts(env, n_questions=300, n_oracle=30))
    model = build_tiny_model(tok, seed=0)
    examples = oracle_examples(tok, env, env.tasks("train", n=64, hops=(2, 2)))
    sft_train(
        model, examples, steps=40, batch_size=4, lr=1e-2, warmup=5, pad_id=tok.pad_token_id, progress=False
    )
    return str(save_pretrained(folder, model, tok))


def echo_env(root: Path) -> Path:
    """OpenEnv's own echo environment, as `openenv init echo_env` writes it (unmodified), under `root`."""
    python = ecosystems_python()
    openenv = Path(python).parent / "openenv"
    subprocess.run([str(openenv), "init", "echo_env"], cwd=root, check=True, capture_output=True, timeout=120)
    assert (root / "echo_env" / "server" / "echo_env_environment.py").is_file()
    return root


def worker_path(monkeypatch, *folders: Path) -> None:
    """The worker of `env.python` imports the environment's modules from these folders."""
    extra = [str(f) for f in folders]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*extra, os.environ.get("PYTHONPATH", "")]))
