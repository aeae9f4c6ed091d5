"""The README's one paragraph on where TreeOPSD wins is generated from the tables' tested claims: each claim
lands under its verdict, the untrained-row claims once even when two tables share their runs, and a table
not run yet is named, not counted."""

from __future__ import annotations

import json

from experiments import wins
from experiments.stats import paired_test


def claim(better: str, worse: str, diffs: list[float]) -> dict:
    return {"better": better, "worse": worse, "test": paired_test(diffs).as_dict()}


def results(commit: str, *claims: dict) -> dict:
    return {"claims": list(claims), "provenance": {"commit": commit}}


def test_claims_land_under_their_verdicts_and_shared_runs_count_once(tmp_path):
    learned = claim("TreeOPSD (4,2)", "warm start (untrained)", [0.10, 0.12, 0.11])  # t = 19.05: holds
    sweep = results(
        "aaa1111",
        claim("TreeOPSD (4,2)", "GRPO (G=8)", [0.05, 0.06, 0.07]),  # mean 0.06, se 0.00577: holds
        claim("TreeOPSD (4,2)", "TreePO (4,2)", [0.01, -0.02, 0.00]),  # not significant
        claim("TreeOPSD (2,2)", "TreeOPSD (4,0)", [-0.04, -0.038, -0.036]),  # reversed
        claim("GRPO (G=8)", "warm start (untrained)", [0.2, 0.3, 0.1]),  # not TreeOPSD's: left out
        learned,
    )
    ablations = results("bbb2222", learned)  # the same runs' claim again
    # a per-question test of one claim: 4 questions, d = (0.1, 0.0, 0.1, 0.0), mean 0.05, se 0.0289
    per_question = paired_test([0.1, 0.0, 0.1, 0.0]).as_dict()
    sweep["question_claims"] = [
        {"better": "TreeOPSD (4,2)", "worse": "GRPO (G=8)", "success": {"test": per_question}}
    ]
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    (tmp_path / "ablations.json").write_text(json.dumps(ablations))
    text = wins.render([tmp_path / "sweep.json", tmp_path / "ablations.json", tmp_path / "real_table.json"])
    assert "from sweep.json at commit aaa1111, ablations.json at commit bbb2222." in text
    # 0.06 / (0.01 / √3) = 10.39; p two-sided with 2 df = 0.009
    assert "TreeOPSD wins: TreeOPSD (4,2) over GRPO (G=8) (sweep: +0.060 ± 0.006 (t = 10.39, df 2" in text
    # 0.05 / 0.0289 = 1.73 with 3 df: p 0.182
    assert "p = 0.009); per question: +0.050 ± 0.029 (t = 1.73, df 3, p = 0.182): not significant)" in text
    assert text.count("per question") == 1  # the claims without one have none
    assert "No difference is shown: TreeOPSD (4,2) over TreePO (4,2) (sweep: -0.003 ± 0.009" in text
    assert "where it loses: TreeOPSD (2,2) over TreeOPSD (4,0) (sweep: -0.038 ± 0.001" in text
    assert text.count("TreeOPSD beats its untrained warm start: TreeOPSD (4,2) (sweep: +0.110") == 1
    assert "(ablations: +0.110" not in text and "GRPO (G=8) over" not in text
    assert "it is not shown to: nowhere." in text and "Not run yet, so not counted: real table." in text


def test_a_file_that_is_not_a_results_file_is_named(tmp_path, capsys):
    bad = tmp_path / "table.md"
    bad.write_text("# a table\n")
    assert wins.main([str(bad), "--out", str(tmp_path / "out.md")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "not a results file" in err[0]
    assert not (tmp_path / "out.md").exists()
