"""A sampler that cannot start makes `treeopsd train` exit at once with one line naming the cause, the config
key and the sampler's log file (actors/failures.py), instead of "no healthy sampler for 180 s"."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray


def test_a_broken_chat_template_ends_train_naming_the_cause(ray_cluster, tmp_path, tiny_model_dir, capsys):
    from transformers import AutoTokenizer

    from launch.cli import main

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    tok = AutoTokenizer.from_pretrained(broken)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}"  # the for is never closed
    for old in broken.glob("chat_template.*"):
        old.unlink()
    tok.save_pretrained(broken)
    run_dir = tmp_path / "run"
    argv = ["train", "--run-dir", str(run_dir), "--steps", "1", "--no-progress", f"model.path={broken}"]
    argv += ["sampler.num_samplers=1", "sampler.unhealthy_grace_s=600", "logging.tensorboard=false"]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    log = Path(run_dir) / "logs" / "sampler-0.log"
    assert code == 2, err
    assert err.startswith("treeopsd train: TemplateSyntaxError: "), err
    assert err.endswith(f"[config key: model.path] (log: {log})"), err
    assert "sampler 0 cannot start" in log.read_text()  # the traceback is in the sampler's own log
