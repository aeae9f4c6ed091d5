"""`treeopsd experiment` end to end on a tiny grid: real training runs in spawned processes, the table,
the JSON, the curves, and a rerun that reuses every finished run."""

from __future__ import annotations

import json

import pytest
import yaml

from experiments.report import verdict
from launch.cli import main


def tiny_spec(tiny_model_dir: str) -> dict:
    return {
        "name": "tiny",
        "base": "configs/default.yaml",
        "seeds": [0, 1],
        "steps": 2,
        "eval_tasks": 4,
        "budget": 8,
        "common": {
            "model.path": tiny_model_dir,
            "env.eval_hops": [3, 4],
            "learner.batch_trees": 2,
            "env.max_turns": 3,
            "env.max_turn_tokens": 12,
        },
        "rows": [
            {"name": "ReAct", "train": False},
            {"name": "TreeOPSD (4,2)", "set": {"algo.M": 4, "algo.N": 2}},
            {"name": "rho = 0.25", "group": "rho", "set": {"algo.rho": 0.25}},
            {"name": "(2,2)", "group": "allocation", "set": {"algo.M": 2, "algo.N": 2}},
        ],
        "claims": [{"better": "TreeOPSD (4,2)", "worse": "ReAct"}],
    }


def test_tiny_grid_writes_table_json_curves_and_resumes(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_spec(tiny_model_dir)))
    out, runs = tmp_path / "out", tmp_path / "runs"
    # --allow-dirty: the suite runs on working trees too; the refusal itself: test_experiment_spec.py
    argv = [
        "experiment",
        str(path),
        "--out",
        str(out),
        "--runs-dir",
        str(runs),
        "--jobs",
        "2",
        "--allow-dirty",
    ]
    assert main(argv) == 0
    data = json.loads((out / "tiny.json").read_text())
    # 4 rows, 3 distinct configs (rho = 0.25 is the (4,2) config) x 2 seeds = 6 runs, none failed
    assert len(data["runs"]) == 6 and data["failed"] == {}
    rows = {r["row"]: r for r in data["rows"]}
    assert all(r["seeds"] == [0, 1] for r in rows.values())
    assert rows["TreeOPSD (4,2)"]["success"] == rows["rho = 0.25"]["success"]  # the same runs
    assert rows["TreeOPSD (4,2)"]["cost"] == 8.0 and rows["(2,2)"]["cost"] == 4.0  # 2 * (1 + 2/2)
    for run in data["runs"].values():
        assert run["eval"]["n"] == 4
        if run["train"]:
            assert run["steps"] == 2 and len(run["curves"]["reward/mean"]) == 2
            assert run["model"].startswith(str(runs))  # the trained checkpoint was evaluated
        else:
            assert run["model"] == tiny_model_dir and run["curves"] == {}
    (claim,) = data["claims"]
    # the claim is the per-seed paired difference of the runs' own held-out success
    success = {(row, r["seed"]): r["eval"]["success"] for r in data["runs"].values() for row in r["rows"]}
    diffs = [success[("TreeOPSD (4,2)", s)] - success[("ReAct", s)] for s in (0, 1)]
    assert claim["seeds"] == 2 and claim["diff"][0] == pytest.approx(sum(diffs) / 2, abs=1e-12)
    assert claim["verdict"] == verdict(diffs)  # its rules: test_verdict_rules below
    table = (out / "tiny.md").read_text()
    assert "| TreeOPSD (4,2) > ReAct | 2 |" in table
    assert "| main | TreeOPSD (4,2) | 8 | 2 |" in table and "![curves](tiny_curves.png)" in table
    png = (out / "tiny_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    capsys.readouterr()

    (first,) = json.loads((runs / "history.json").read_text())
    assert first["runs"] == 6 and first["jobs"] == 2
    assert main(argv) == 0  # every run has a result.json: nothing runs again, same table
    assert "6 runs, 6 already done" in capsys.readouterr().err
    again = json.loads((out / "tiny.json").read_text())
    assert again["rows"] == data["rows"] and again["provenance"]["executed_by"] == [first]
    assert (
        f"Runs executed by commit {first['commit']} from {first['date']} (6 runs,"
        in (out / "tiny.md").read_text()
    )


def test_verdict_rules():
    """Paired differences (better - worse) per seed -> the verdict of a two-sided t-test, n − 1 df."""
    assert verdict([0.0, 0.0]) == "tie"
    assert verdict([0.5, 0.5, 0.5]) == "holds"  # mean 0.5, se 0: t infinite
    # mean 0.25, se 0.05: t = 5 with 1 df, p = 0.126 — "above 2 se" is not significant with 2 seeds
    assert verdict([0.3, 0.2]) == "not significant"
    assert verdict([0.3, 0.2, 0.25, 0.28]) == "holds"  # mean 0.2575, se 0.0217: t 11.9, df 3, p 0.001
    assert verdict([0.3, -0.1]) == "not significant"  # mean 0.1, se 0.2
    assert verdict([-0.5, -0.25, -0.4]) == "reversed"  # mean -0.383, se 0.073: t -5.28, df 2, p 0.034
    assert verdict([0.4]) == "one pair: no test"
    assert verdict([0.5, -0.5]) == "not significant"  # mean 0, se 0.5
    assert verdict([]) == "no data"
