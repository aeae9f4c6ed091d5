"""The tiny model's warm-start announces itself before it builds (minutes on 2 cores, with or without a
progress bar), and says nothing when the cache already holds it (runtime/model_setup.py)."""

import runtime.model_setup as setup
from configs.schema import parse_config


def test_a_build_is_announced_and_a_cached_model_is_not(tmp_path, monkeypatch, capsys):
    cfg = parse_config({}, [f"run.run_dir={tmp_path / 'runs' / 'r1'}"])
    monkeypatch.setattr(setup, "warm_start_tiny", lambda cfg, out, progress: {"model_dir": str(out)})
    out = setup.resolve_model(cfg, progress=False)
    assert out.startswith(str(tmp_path / "runs" / "models" / "tiny-"))  # beside the run directory
    assert f"warm-starting it (1200 SFT steps, ~2 min on 2 cores) into {out}" in capsys.readouterr().err
    for name in ("warmstart.json", "model.safetensors"):  # what a finished warm-start leaves
        (tmp_path / "runs" / "models" / out.rsplit("/", 1)[1]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "runs" / "models" / out.rsplit("/", 1)[1] / name).write_text("x")
    other_run = parse_config({}, [f"run.run_dir={tmp_path / 'runs' / 'r2'}"])  # another run, same folder
    assert setup.resolve_model(other_run, progress=False) == out
    assert capsys.readouterr().err == ""
