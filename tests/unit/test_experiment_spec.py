"""The experiment grid's spec, plan and statistics (launch/experiment.py, launch/experiment_plot.py)."""

from __future__ import annotations

import math

import pytest

from launch.experiment import (
    ExperimentSpecError,
    check_claims,
    load_spec,
    mean_se,
    parse_spec,
    plan,
    render_claims,
    render_table,
    resolved_config,
    rows_summary,
)
from launch.experiment_plot import smooth


def _doc(**over):
    doc = {
        "name": "t",
        "seeds": [0, 1],
        "steps": 3,
        "eval_tasks": 4,
        "budget": 8,
        "rows": [
            {"name": "ReAct", "train": False},
            {"name": "GRPO", "set": {"algo.method": "grpo", "algo.G": 8}},
            {"name": "TreeOPSD", "set": {"algo.M": 4, "algo.N": 2, "algo.rho": 0.25}},
            {"name": "rho = 0.25", "group": "rho", "set": {"algo.rho": 0.25}},
        ],
    }
    doc.update(over)
    return doc


def test_paper_table_spec_plans_every_row_and_matches_the_budget():
    spec = load_spec("configs/paper_table.yaml")
    assert spec.seeds == (0, 1, 2) and len(spec.rows) == 15
    assert [spec.model_seed(s) for s in spec.seeds] == [0, 0, 0]  # one warm-started model for every seed
    runs = plan(spec)
    assert all(r.key.endswith(f"-s{r.seed}-w0") for r in runs)
    # 15 rows, but "rho = 0.25" is the TreeOPSD (4,2) config: 14 distinct configs x 3 seeds = 42 runs.
    assert len(runs) == 42
    shared = [r for r in runs if len(r.rows) > 1]
    assert len(shared) == 3 and all(set(r.rows) == {"TreeOPSD (4,2)", "rho = 0.25"} for r in shared)
    costs = {row.name: resolved_config(spec, row, 0).algo.expected_cost for row in spec.rows if row.train}
    # M(1 + N/2): (4,2) -> 8, (8,0) -> 8, (2,6) -> 2*4 = 8, (2,2) -> 4, (4,0) -> 4; G = 8 for GRPO/GSPO.
    assert costs["GRPO (G=8)"] == costs["TreeOPSD (4,2)"] == costs["TreeOPSD (2,6)"] == 8.0
    assert costs["TreeOPSD (2,2), half budget"] == costs["TreeOPSD (4,0), half budget"] == 4.0
    listwise = next(r for r in spec.rows if r.name.startswith("listwise"))
    assert resolved_config(spec, listwise, 0).algo.credit == "listwise"
    quick = load_spec("configs/paper_table.yaml", quick=True)
    assert (quick.steps, quick.eval_tasks, quick.quick) == (6, 40, True)


def test_plan_shares_runs_between_equal_configs_and_orders_by_seed():
    runs = plan(parse_spec(_doc()))
    # 4 rows, 3 distinct configs (TreeOPSD == rho = 0.25), 2 seeds.
    assert [r.seed for r in runs] == [0, 0, 0, 1, 1, 1]
    assert [r.train for r in runs[:3]] == [False, True, True]
    assert runs[2].rows == ("TreeOPSD", "rho = 0.25")


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"rows": [{"name": "x", "set": {"algo.rho": 0.7}}]}, "row 'x': algo.rho"),
        ({"rows": [{"name": "x", "set": {"algo.nope": 1}}]}, "row 'x'"),
        ({"rows": [{"name": "x", "colour": 1}]}, "unknown keys ['colour']"),
        ({"rows": [{"name": "a"}, {"name": "a", "set": {"algo.rho": 0.2}}]}, "row names repeat: ['a']"),
        ({"seeds": [1, 1]}, "repeat a seed"),
        ({"seeds": []}, "seeds must be a non-empty list"),
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"warmstart_seed": -1}, "warmstart_seed must be an integer >= 0"),
        ({"extra": 1}, "unknown keys ['extra']"),
        ({"rows": [{"name": "cheap", "set": {"algo.M": 2, "algo.N": 2}}]}, "costs 4 full trajectories"),
        ({"rows": [{"name": "x", "set": [1]}]}, "must be a mapping"),
        ({"claims": [{"better": "GRPO", "worse": "nope"}]}, "claims[0].worse = 'nope' is not a row name"),
        ({"claims": [{"better": "GRPO"}]}, "claims[0] must be a mapping with keys better and worse"),
    ],
)
def test_bad_specs_name_the_problem(over, needle):
    with pytest.raises(ExperimentSpecError) as e:
        parse_spec(_doc(**over), "spec.yaml")
    assert needle in str(e.value) and "spec.yaml" in str(e.value)


def test_missing_and_malformed_spec_files(tmp_path):
    with pytest.raises(ExperimentSpecError, match="does not exist"):
        load_spec(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rows: [\n")
    with pytest.raises(ExperimentSpecError, match="not valid YAML"):
        load_spec(bad)


def test_mean_and_standard_error():
    m, se = mean_se([0.5, 0.6, 0.7])
    # mean 0.6; sample variance (0.01 + 0 + 0.01) / 2 = 0.01, sd 0.1; se = 0.1 / sqrt(3) = 0.0577350
    assert m == pytest.approx(0.6) and se == pytest.approx(0.1 / math.sqrt(3))
    m1, se1 = mean_se([0.25])
    assert m1 == 0.25 and math.isnan(se1)
    assert all(math.isnan(x) for x in mean_se([]))


def test_smooth_is_a_trailing_moving_average():
    # window 2: [1, (1+2)/2, (2+3)/2, (3+4)/2]
    assert smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert smooth([1.0, math.nan, 3.0], 3) == [1.0, 1.0, 2.0]


def test_rows_summary_and_table():
    spec = parse_spec(_doc())
    runs = plan(spec)

    def res(run, success, h3, h4):
        per_hop = {"3": {"success": h3}, "4": {"success": h4}}
        return {
            "rows": list(run.rows),
            "seed": run.seed,
            "expected_cost": 8.0,
            "eval": {"success": success, "per_hop": per_hop},
        }

    results = {
        runs[0].key: res(runs[0], 0.4, 0.5, 0.3),
        runs[2].key: res(runs[2], 0.5, 0.6, 0.4),
        runs[5].key: res(runs[5], 0.7, 0.8, 0.6),  # TreeOPSD seed 1; GRPO has no finished run
    }
    rows = {s["row"]: s for s in rows_summary(spec, results)}
    assert rows["TreeOPSD"]["seeds"] == [0, 1] and rows["rho = 0.25"]["seeds"] == [0, 1]
    # mean (0.5 + 0.7) / 2 = 0.6; sd = sqrt(2 * 0.1**2 / 1) = 0.141421; se = sd / sqrt(2) = 0.1
    assert rows["TreeOPSD"]["success"] == pytest.approx((0.6, 0.1))
    assert rows["ReAct"]["cost"] == 0.0 and rows["TreeOPSD"]["cost"] == 8.0
    table = render_table(spec, list(rows.values()))
    lines = table.splitlines()
    assert lines[2] == "| main | ReAct | — | 1 | 0.400 | 0.500 | 0.300 |"
    assert lines[3] == "| main | GRPO | — | 0 | — | — | — |"
    assert lines[4] == "| main | TreeOPSD | 8 | 2 | 0.600 ± 0.100 | 0.700 ± 0.100 | 0.500 ± 0.100 |"


def test_claims_use_paired_per_seed_differences():
    claims = [
        {"better": "TreeOPSD", "worse": "GRPO"},
        {"better": "GRPO", "worse": "TreeOPSD"},
        {"better": "TreeOPSD", "worse": "ReAct"},
        {"better": "TreeOPSD", "worse": "rho = 0.25"},
    ]
    spec = parse_spec(_doc(seeds=[0, 1, 2], claims=claims))
    success = {("ReAct", 0): 0.50, ("ReAct", 1): 0.50, ("ReAct", 2): 0.50,
               ("GRPO", 0): 0.40, ("GRPO", 1): 0.60, ("GRPO", 2): 0.45,
               ("TreeOPSD", 0): 0.45, ("TreeOPSD", 1): 0.66, ("TreeOPSD", 2): 0.52}  # fmt: skip
    results = {}
    for run in plan(spec):
        results[run.key] = {"rows": list(run.rows), "seed": run.seed,
                            "eval": {"success": success[(run.rows[0], run.seed)]}}  # fmt: skip
    got = check_claims(spec, results)
    # TreeOPSD - GRPO per seed: 0.05, 0.06, 0.07 -> mean 0.06, sd 0.01, se 0.01/sqrt(3) = 0.00577 < 0.06 / 2
    assert got[0]["diff"] == pytest.approx((0.06, 0.01 / math.sqrt(3))) and got[0]["verdict"] == "reproduced"
    assert got[1]["verdict"] == "reversed"
    # TreeOPSD - ReAct: -0.05, +0.16, +0.02 -> mean 0.0433, sd 0.1069, se 0.0617: within 2 se of 0
    assert got[2]["verdict"] == "within noise (same direction)" and got[2]["seeds"] == 3
    assert got[3]["verdict"] == "tie"  # the same runs
    md = render_claims(got)
    assert "| TreeOPSD > GRPO | 3 | +0.060 ± 0.006 | reproduced |" in md
