"""`treeopsd report RUN_DIR`: PNGs from synthetic tensorboard logs, checked as images and by panel titles."""

import json

import numpy as np
from matplotlib.image import imread

from launch.cli import main
from storage.metrics import TensorboardSink

PANELS = {
    "reward.png": ["Reward (mean leaf reward per batch)", "Evaluation success"],
    "staleness.png": ["Version lag of trained trees", "Stale trees per batch", "Trees pending in the store"],
    "mismatch.png": [
        "Mismatch μ vs π_prox (k3) by version lag",
        "Mismatch μ vs π_prox (k1)",
        "Importance weight",
        "Clipped and masked by the correction",
        "Turns cut at the token limit",
    ],
    "throughput.png": [
        "Sampler: tokens per second",
        "Sampler: idle ratio",
        "Sampler: wait for weights",
        "Learner: step time",
        "Learner: idle ratio",
        "Learner: wait for a batch",
    ],
    "minibatches.png": [
        "Loss per mini-batch",
        "Overshoot fraction per mini-batch",
        "Mean |s| per mini-batch",
        "KL to target per mini-batch",
    ],
}
TAB_BLUE = np.array([31, 119, 180]) / 255  # the first line colour of every panel


def write_run(run_dir, steps=6, tags=None):
    """A few learner steps of every tag the driver logs, with 2 mini-batch indices; eval/success left out."""
    rng = np.random.default_rng(0)
    sink = TensorboardSink(run_dir / "tb")
    for step in range(1, steps + 1):
        metrics = {
            "reward/mean": 0.3 + 0.05 * step + 0.02 * rng.standard_normal(),
            "learner/loss": 0.01 / step,
            "learner/kl_to_target": 0.002 / step,
            "learner/step_s": 0.4 + 0.1 * rng.random(),
            "learner/idle_ratio": 0.2 + 0.1 * rng.random(),
            "learner/wait_for_batch_s": 0.1 * rng.random(),
            "store/stale_trees": float(step % 3),
            "weights/version_lag": 0.5 * (step % 3),
            "weights/version_lag_max": float(step % 3),
            "tree/leaves": 12.0,
            "backup/trees": 4.0 * step,
            "mismatch/k3": 0.01 * step,
            "mismatch/k3_lag0": 1e-4,
            "mismatch/k1": 0.012 * step,
            "correction/weight_mean": 0.98,
            "correction/weight_max": 2.0,
            "tree/truncated_frac": 0.02,
            "correction/clipped_token_frac": 0.05,
            "correction/masked_token_frac": 0.0,
        }
        for k in range(2):
            metrics |= {
                f"learner/mb{k}/loss": (0.01 + 0.002 * k) / step,
                f"learner/mb{k}/overshoot_frac": 0.05 * k + 0.01 * step,
                f"learner/mb{k}/mean_abs_s": 0.02 * (k + 1) * rng.random(),
                f"learner/mb{k}/kl_to_target": 0.002 * (k + 1) / step,
            }
        batches = [metrics]
        for _ in range(2):  # the driver flushes role metrics more than once per learner step
            batches.append(
                {
                    "sampler/tokens_per_s": 900 + 50 * rng.standard_normal(),
                    "sampler/idle_ratio": 0.1 * rng.random(),
                    "sampler/wait_for_weights_s": 1e-3 * rng.random(),
                    "store/trees_pending": float(rng.integers(0, 5)),
                }
            )
        for batch in batches:
            sink.log({k: v for k, v in batch.items() if tags is None or k in tags}, step)
    sink.close()


def check_png(path, expect_lines=True):
    img = imread(path)
    h, w = img.shape[:2]
    assert h > 200 and w > 200, (path, img.shape)
    assert img[..., :3].std() > 0, f"{path} is one flat colour"
    near_blue = np.abs(img[..., :3] - TAB_BLUE).max(axis=-1) < 0.04
    assert near_blue.any() == expect_lines, f"{path}: data lines drawn = {near_blue.any()}"


def test_report_renders_every_figure_with_its_panels(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run)
    (run / "demo.json").write_text(json.dumps({"success_before": 0.25, "success_after": 0.5, "steps": 6}))
    assert main(["report", str(run)]) == 0
    out = run / "report"
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / n) for n in (*PANELS, "panels.json", "index.md")]
    assert json.loads((out / "panels.json").read_text()) == PANELS
    for name in PANELS:
        check_png(out / name)
    index = (out / "index.md").read_text()
    assert all(f"({name})" in index for name in PANELS)
    assert "| loss | `learner/loss` | 0.001667 | 6 | 6 |" in index  # final value 0.01 / 6
    assert "| `learner/mb1/overshoot_frac` | 0.11 | 6 |" in index
    assert "| evaluation success | `eval/success` | no data |" in index
    assert "- success after training: 0.5" in index


def test_missing_tags_give_no_data_panels_not_errors(tmp_path, capsys):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    write_run(run, steps=2, tags={"reward/mean"})
    assert main(["report", str(run), "--out", str(elsewhere)]) == 0
    assert not (run / "report").exists()
    assert json.loads((elsewhere / "panels.json").read_text()) == PANELS  # same layout, empty panels
    check_png(elsewhere / "reward.png")
    for name in ("staleness.png", "throughput.png", "minibatches.png"):
        check_png(elsewhere / name, expect_lines=False)
    assert "| loss | `learner/loss` | no data | | 0 |" in (elsewhere / "index.md").read_text()


def test_run_dir_without_tb_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "has no tb/ directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()
