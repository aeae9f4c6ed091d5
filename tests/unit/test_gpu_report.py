"""benchmarks/gpu_report.py: per-shape runs merged into the results file, and the docs/results.md table with
its goals read off the figures (met or not, never typed)."""

import json

from benchmarks.gpu_report import main, render


def layout(tok_s: int, peak: float) -> dict:
    rates = {"tokens_per_s": tok_s, "path_tokens_per_s": 2 * tok_s, "mfu": 0.1, "step_s": 3.0}
    return {
        **rates,
        "first_step_s": 30.0,
        "peak_gib": peak,
        "model_gib": peak + 1,
        "compiles": 4,
        "pad_frac": 0.08,
    }


def test_merge_keeps_earlier_shapes_and_goals_follow_the_figures(tmp_path):
    target = tmp_path / "learner_gpu.json"
    target.write_text(
        json.dumps({"qwen3-0.6b": {"packed": layout(25_000, 12.0), "paths": layout(20_000, 12.0)}})
    )
    run = tmp_path / "run_4b.json"
    run.write_text(
        json.dumps(
            {
                "device": "H",
                "torch": "t",
                "qwen3-4b": {"packed": layout(5_000, 75.0), "paths": layout(4_000, 75.0)},
            }
        )
    )
    assert main([str(target), str(run)]) == 0
    merged = json.loads(target.read_text())
    assert set(merged) == {"device", "torch", "qwen3-0.6b", "qwen3-4b"}
    md = (tmp_path / "learner_gpu.md").read_text()
    assert "| qwen3-0.6b | packed | 25,000 | 50,000 | 10.0 % | 3.00 | 30.0 | 12.0 (13.0) | 4 | 8.0 % |" in md
    assert "* qwen3-0.6b: 25,000 ≥ 20,000: met" in md
    assert "* qwen3-4b: 5,000 ≥ 6,000: not met" in md
    # 80 GB = 80e9 / 2^30 = 74.5 GiB: 75.0 is over it
    assert "* qwen3-4b peak: 75.0 GiB ≤ 74.5 GiB: not met" in md
    assert render(merged) == md
