"""Paired differences per held-out question (pure; no torch, no files): beside the per-seed test of
experiments/report.py `check_claims`, each ordering "better > worse" tested over the questions that every
row of a seed answered, and how many questions a test at that spread would need.

    claims = question_claims(spec, results)        # results: run key -> result.json content
    text = render_question_claims(claims)

Per question q and seed s, d(q, s) = reward of the better row − reward of the worse row on q (greedy: 0/1;
sampled: the mean over the question's samples). The rows of one seed share the question list, the start
model and the sampling seed, so d(q, s) pairs like with like. The test averages d over the seeds first,
d(q) = mean_s d(q, s), then runs the paired t-test over the questions (t with n_questions − 1 degrees of
freedom, experiments/stats.py): it asks whether the ordering holds on new questions of this kind, for
models trained with these seeds. The per-seed test asks whether it holds for new seeds on these questions;
a table shows both.

"Questions needed": at the spread observed here (the sd of d(q) over questions, with this many seeds),
the questions a paired test needs for 80 % power at 5 % against the observed |mean| and against a
reference difference (`REFERENCE_EFFECT`), by `pairs_needed`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from experiments.grid import Spec
from experiments.stats import PairedTest, paired_test, pairs_needed

REFERENCE_EFFECT = 0.10  # a difference worth detecting on held-out success (10 points)
QUESTION_NOTE = (
    "d(q) = better − worse on question q, averaged over the seeds; t over the questions with n − 1 df; "
    "questions needed: for 80 % power at 5 % at this spread, against the observed difference and against "
    "±0.10: experiments/question_pairs.py"
)
PER_TASK = (("success", "task_rewards"), ("sampled_success", "sampled_task_rewards"))


def _per_task(results: Mapping[str, Mapping[str, Any]], key: str) -> dict[str, dict[int, dict[str, float]]]:
    """row -> seed -> question id -> reward, from each run's evaluation (`key`: task_rewards or
    sampled_task_rewards); runs without them are left out."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for r in results.values():
        rewards = r.get("eval", {}).get(key)
        if not isinstance(rewards, Mapping):
            continue
        for name in r["rows"]:
            out.setdefault(name, {})[int(r["seed"])] = {str(k): float(v) for k, v in rewards.items()}
    return out


def question_differences(
    better: Mapping[int, Mapping[str, float]], worse: Mapping[int, Mapping[str, float]]
) -> tuple[list[int], dict[str, float]]:
    """(the seeds both rows ran, question -> d(q) averaged over those seeds) over the questions every one
    of those seeds evaluated for both rows."""
    seeds = sorted(set(better) & set(worse))
    if not seeds:
        return [], {}
    shared = set.intersection(*(set(better[s]) & set(worse[s]) for s in seeds))
    return seeds, {q: sum(better[s][q] - worse[s][q] for s in seeds) / len(seeds) for q in sorted(shared)}


def needed(sd: float, effect: float) -> int | None:
    """Questions for 80 % power at 5 % (None when the spread or the effect is zero or unknown)."""
    if not (sd == sd and effect == effect) or sd <= 0 or effect <= 0:
        return None
    return pairs_needed(sd, effect)


def question_claims(spec: Spec, results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per claim of the spec and per metric (greedy, sampled): the seeds, the questions, the per-question
    paired test, the sd of d(q) and the questions needed (module docstring)."""
    tables = {metric: _per_task(results, key) for metric, key in PER_TASK}
    out = []
    for better, worse in spec.claims:
        claim: dict[str, Any] = {"better": better, "worse": worse}
        for metric, _ in PER_TASK:
            rows = tables[metric]
            seeds, diffs = question_differences(rows.get(better, {}), rows.get(worse, {}))
            test = paired_test(list(diffs.values()))
            claim[metric] = {
                "seeds": seeds,
                "questions": len(diffs),
                "test": test.as_dict(),
                "sd": test.sd,
                "needed_observed": needed(test.sd, abs(test.mean)),
                "needed_reference": needed(test.sd, REFERENCE_EFFECT),
            }
        out.append(claim)
    return out


def _cell(c: Mapping[str, Any]) -> str:
    if not c["questions"]:
        return "no per-question data"
    line = PairedTest(**c["test"]).line()
    observed = c["needed_observed"]
    at_observed = "—" if observed is None else str(observed)
    at_reference = "—" if c["needed_reference"] is None else str(c["needed_reference"])
    return f"{line}; questions needed: {at_observed} (observed), {at_reference} (±{REFERENCE_EFFECT:.2f})"


def render_question_claims(claims: Sequence[Mapping[str, Any]], what: str = "ordering") -> str:
    """Markdown: per claim, the seeds and questions paired, then per metric the mean of d(q) ± se (t, df,
    p): verdict, and the questions a test would need at this spread."""
    lines = [
        f"| {what} | seeds | questions | greedy success per question | sampled pass@1 per question |",
        "|---|---:|---:|---|---|",
    ]
    for c in claims:
        g, s = c["success"], c["sampled_success"]
        head = f"| {c['better']} > {c['worse']} | {len(g['seeds'])} | {g['questions']}"
        lines.append(f"{head} | {_cell(g)} | {_cell(s)} |")
    return "\n".join(lines)
