"""The experiment grid's spec, plan and statistics (experiments/grid.py, experiments/plot.py)."""

from __future__ import annotations

import math

import pytest

from experiments.grid import ExperimentSpecError, load_spec, parse_spec, plan, resolved_config
from experiments.plot import smooth
from experiments.report import (
    check_claims,
    mean_se,
    render_claims,
    render_findings,
    render_table,
    rows_summary,
)


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
    assert spec.seeds == (0, 1, 2, 3, 4) and spec.ablation_seeds == (0, 1, 2) and len(spec.rows) == 8
    assert [spec.model_seed(s) for s in spec.seeds] == [0] * 5  # one warm-started model for every seed
    runs = plan(spec)
    assert all(r.key.endswith(f"-s{r.seed}-w0") for r in runs)
    # 5 main rows x 5 seeds (the ReAct row's 5 are evaluations only) + 3 ablations x 3 seeds = 34 runs.
    assert len(runs) == 34 and sum(not r.train for r in runs) == 5
    costs = {row.name: resolved_config(spec, row, 0).algo.expected_cost for row in spec.rows if row.train}
    # M(1 + N/2): (4,2) -> 8, (8,0) -> 8, (2,6) -> 2*4 = 8; G = 8 for GRPO/GSPO.
    assert set(costs.values()) == {8.0}
    cfg = resolved_config(spec, spec.rows[4], 0)
    assert (cfg.env.train_hops, cfg.env.eval_hops, cfg.env.eval_per_hop) == ((4, 5), (4, 5), 400)
    assert spec.eval_tasks == 800 and spec.samples == 4  # 400 questions per hop count, 4 samples each
    depth = next(r for r in spec.rows if "depth" in r.name)
    assert resolved_config(spec, depth, 0).algo.depth_correction
    quick = load_spec("configs/paper_table.yaml", quick=True)
    assert (quick.steps, quick.eval_tasks, quick.quick, len(plan(quick))) == (4, 40, True, 13)


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

    def res(run, success, h3, h4, sampled=None, curve=()):
        per_hop = {"3": {"success": h3}, "4": {"success": h4}}
        ev = {"success": success, "per_hop": per_hop}
        if sampled is not None:
            ev.update(sampled_success=sampled, pass_at_k=min(1.0, 2 * sampled))
        return {
            "rows": list(run.rows),
            "seed": run.seed,
            "expected_cost": 8.0,
            "eval": ev,
            "curves": {"reward/mean": list(curve)},
        }

    # 20 steps: the rise compares the mean of the last 2 with the mean of the first 2 (a tenth each)
    up = [0.1, 0.3] + [0.5] * 16 + [0.6, 0.8]  # (0.6 + 0.8)/2 − (0.1 + 0.3)/2 = 0.5
    results = {
        runs[0].key: res(runs[0], 0.4, 0.5, 0.3),
        runs[2].key: res(runs[2], 0.5, 0.6, 0.4, sampled=0.3, curve=up),
        runs[5].key: res(runs[5], 0.7, 0.8, 0.6, sampled=0.4, curve=[0.2] * 20),  # TreeOPSD seed 1; rise 0
    }  # GRPO has no finished run
    rows = {s["row"]: s for s in rows_summary(spec, results)}
    assert rows["TreeOPSD"]["seeds"] == [0, 1] and rows["rho = 0.25"]["seeds"] == [0, 1]
    # mean (0.5 + 0.7) / 2 = 0.6; sd = sqrt(2 * 0.1**2 / 1) = 0.141421; se = sd / sqrt(2) = 0.1
    assert rows["TreeOPSD"]["success"] == pytest.approx((0.6, 0.1))
    assert rows["ReAct"]["cost"] == 0.0 and rows["TreeOPSD"]["cost"] == 8.0
    # sampled: (0.3 + 0.4)/2 = 0.35, se 0.05; pass@k: 0.6, 0.8 -> 0.7 ± 0.1; rise: (0.5 + 0)/2 = 0.25 ± 0.25
    assert rows["TreeOPSD"]["sampled_success"] == pytest.approx((0.35, 0.05))
    assert rows["TreeOPSD"]["reward_rise"] == pytest.approx((0.25, 0.25))
    table = render_table(spec, list(rows.values()))
    lines = table.splitlines()
    assert lines[0].startswith(
        "| group | method | cost | seeds | greedy success | 3-hop | 4-hop | sampled pass@1"
    )
    assert lines[2] == "| main | ReAct | — | 1 | 0.400 | 0.500 | 0.300 | — | — | — |"
    assert lines[3] == "| main | GRPO | — | 0 | — | — | — | — | — | — |"
    assert lines[4] == (
        "| main | TreeOPSD | 8 | 2 | 0.600 ± 0.100 | 0.700 ± 0.100 | 0.500 ± 0.100 | 0.350 ± 0.050 "
        "| 0.700 ± 0.100 | +0.250 ± 0.250 |"
    )


def test_claims_use_paired_per_seed_differences():
    claims = [
        {"better": "TreeOPSD", "worse": "GRPO"},
        {"better": "GRPO", "worse": "TreeOPSD"},
        {"better": "TreeOPSD", "worse": "ReAct"},
        {"better": "TreeOPSD", "worse": "rho = 0.25"},
    ]
    spec = parse_spec(_doc(seeds=[0, 1, 2], claims=claims))
    success = {
        ("ReAct", 0): 0.50,    ("ReAct", 1): 0.50,    ("ReAct", 2): 0.50,
        ("GRPO", 0): 0.40,     ("GRPO", 1): 0.60,     ("GRPO", 2): 0.45,
        ("TreeOPSD", 0): 0.45, ("TreeOPSD", 1): 0.66, ("TreeOPSD", 2): 0.52,
    }  # fmt: skip  # a table: one row per method, one column per seed, aligned
    results = {}
    for run in plan(spec):
        greedy = success[(run.rows[0], run.seed)]
        results[run.key] = {
            "rows": list(run.rows),
            "seed": run.seed,
            "eval": {"success": greedy, "sampled_success": greedy / 2},
        }
    got = check_claims(spec, results)
    # TreeOPSD - GRPO per seed: 0.05, 0.06, 0.07 -> mean 0.06, sd 0.01, se 0.01/sqrt(3) = 0.00577,
    # t = 0.06 / 0.00577 = 10.39 with 2 degrees of freedom: two-sided p = 0.009 < 0.05
    assert got[0]["diff"] == pytest.approx((0.06, 0.01 / math.sqrt(3))) and got[0]["verdict"] == "holds"
    assert got[0]["test"]["t"] == pytest.approx(10.392, abs=1e-3) and got[0]["test"]["df"] == 2
    assert got[0]["test"]["p"] == pytest.approx(0.00913, abs=1e-4)
    assert got[1]["verdict"] == "reversed" and got[1]["test"]["mean"] < 0  # negative, printed as such
    # TreeOPSD - ReAct: -0.05, +0.16, +0.02 -> mean 0.0433, sd 0.1069, se 0.0617, t 0.70: p 0.55
    assert got[2]["verdict"] == "not significant" and got[2]["seeds"] == 3
    assert got[3]["verdict"] == "tie"  # the same runs
    # sampled = greedy / 2 here: differences 0.025, 0.03, 0.035 -> +0.030 ± 0.003, t = 10.39 again
    assert got[0]["sampled_diff"] == pytest.approx((0.03, 0.005 / math.sqrt(3)))
    assert got[0]["sampled_verdict"] == "holds"
    md = render_claims(got)
    row = "| TreeOPSD > GRPO | 3 | +0.060 ± 0.006 (t = 10.39, df 2, p = 0.009): holds | "
    assert row + "+0.030 ± 0.003 (t = 10.39, df 2, p = 0.009): holds |" in md
    words = render_findings(got, 100)
    assert "Wins: TreeOPSD over GRPO, +0.060 ± 0.006 (t = 10.39, df 2, p = 0.009)." in words
    assert "Losses: GRPO over TreeOPSD, -0.060 ± 0.006 (t = -10.39, df 2, p = 0.009)." in words
    # TreeOPSD - ReAct: +0.0433 ± 0.0617, t(0.975, 2) = 4.303: 0.0433 ± 0.2654 -> [-0.222, +0.309];
    # seeds for 80 % power: sd 0.1069, ((1.960 + 0.842) * 0.1069 / 0.0433)^2 = 47.9, + 1.96^2 / 2 -> 50
    assert "No difference shown: TreeOPSD over ReAct, +0.043 ± 0.062 (t = 0.70, df 2, p = 0.555), " in words
    assert "95 % interval [-0.222, +0.309]; 50 seeds would show a true difference of 0.043; " in words
    assert "TreeOPSD over rho = 0.25, the same success in each of 3 seeds." in words
    assert words.index("Wins") < words.index("No difference") < words.index("Losses")
    assert "Losses: none." in render_findings(got[:1], 100)
    assert "longer training than 100 learner steps per run." in words


def test_results_from_uncommitted_code_are_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    import yaml

    from experiments import provenance
    from launch.cli import main

    spec = tmp_path / "t.yaml"
    spec.write_text(yaml.safe_dump(_doc(base="configs/default.yaml")))
    out, runs = tmp_path / "out", tmp_path / "runs"
    argv = ["experiment", str(spec), "--out", str(out), "--runs-dir", str(runs)]
    monkeypatch.setattr(provenance, "is_dirty", lambda: True)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("treeopsd experiment: the working tree has uncommitted")
    assert "--allow-dirty" in err and not out.exists() and not runs.exists()  # nothing ran, nothing written
    stamp = provenance.require_clean(allow_dirty=True)  # told to: it runs, and the stamp says so
    assert stamp["clean"] is False and "uncommitted" in stamp["note"]
