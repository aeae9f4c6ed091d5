"""The experiment grid's statistics and tables (pure; no torch, no files): per-row summaries over seeds,
the paper's orderings checked with per-seed paired differences, and their markdown.

    summary = rows_summary(spec, results)          # results: run key -> result.json content
    table, claims = render_table(spec, summary), check_claims(spec, results)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.grid import Spec
from experiments.stats import PairedTest, paired_test, pairs_needed

METRICS = ("success", "sampled_success")  # greedy success; sampled pass@1 (temperature 1)
# training diagnostics averaged over a run's steps (then over seeds); a column where any row logged one
DIAGNOSTICS = (
    ("tree/sampled_tokens", "sampled tokens/step"),
    ("weights/version_lag", "mean lag"),
    ("mismatch/k3", "mismatch k3 (μ vs step start)"),
    ("correction/weight_mean", "IS weight"),
    ("correction/clipped_token_frac", "clipped tokens"),
    ("correction/turn_kl", "turn KL"),
    ("correction/turn_ess", "ESS"),
    ("store/lag_limit", "lag admitted"),
    ("tree/truncated_frac", "cut turns"),
)

# held-out sampled episodes (T = 1): −mean log π of their tokens, an estimate of the trained policy's entropy
ENTROPY = ("eval/sampled_token_nll", "entropy after (nats/token, T=1)")


def mean_se(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n)); se is nan for a single value."""
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    m = sum(xs) / n
    if n == 1:
        return m, math.nan
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def _reward_rise(curve: Sequence[float]) -> float:
    """Mean training reward over the last tenth of the steps minus over the first tenth."""
    k = max(1, len(curve) // 10)
    head, tail = [x for x in curve[:k] if x == x], [x for x in curve[-k:] if x == x]
    return sum(tail) / len(tail) - sum(head) / len(head) if head and tail else math.nan


def eval_hops(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The hop counts the evaluations report (per_hop keys), in order."""
    hops = {h for r in results.values() for h in r.get("eval", {}).get("per_hop", {})}
    return sorted(hops, key=int)


def rows_summary(spec: Spec, results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per row, mean ± se over the seeds whose runs finished: greedy success (overall and per hop count),
    sampled success (pass@1) and pass@K, and the training-reward rise (last tenth − first tenth of steps)."""
    out = []
    for row in spec.rows:
        got = [r for r in results.values() if row.name in r["rows"] and "eval" in r]
        summary: dict[str, Any] = {
            "row": row.name,
            "group": row.group,
            "seeds": sorted(r["seed"] for r in got),
        }
        summary["cost"] = got[0]["expected_cost"] if got and row.train else 0.0
        summary["success"] = mean_se([r["eval"]["success"] for r in got])
        summary["per_hop"] = {
            h: mean_se([r["eval"].get("per_hop", {}).get(h, {}).get("success", math.nan) for r in got])
            for h in eval_hops(results)
        }
        for key in ("sampled_success", "pass_at_k"):
            summary[key] = mean_se([r["eval"][key] for r in got if key in r["eval"]])
        rises = [
            _reward_rise(r["curves"]["reward/mean"]) for r in got if r.get("curves", {}).get("reward/mean")
        ]
        summary["reward_rise"] = mean_se(rises)
        summary["diagnostics"] = {key: mean_se(_curve_means(got, key)) for key, _ in DIAGNOSTICS}
        nll = [r["eval"]["sampled"]["token_nll"] for r in got if "token_nll" in r["eval"].get("sampled", {})]
        summary["diagnostics"][ENTROPY[0]] = mean_se(nll)  # the policy's entropy after training, per token
        summary["train_s"] = sum(r.get("train_s", 0.0) for r in got) / max(1, len(got))
        out.append(summary)
    return out


def _curve_means(runs: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """Per run, the mean of its curve `key` over the steps that logged it (runs without it left out)."""
    out = []
    for r in runs:
        values = [x for x in r.get("curves", {}).get(key, []) if x == x]
        if values:
            out.append(sum(values) / len(values))
    return out


def _fmt(ms: tuple[float, float], signed: bool = False) -> str:
    m, se = ms
    if math.isnan(m):
        return "—"
    digits = 0 if abs(m) >= 100 else 3  # token counts in whole tokens, rates to three places
    head = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    return head if math.isnan(se) else f"{head} ± {se:.{digits}f}"


def render_table(spec: Spec, summary: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one line per row, grouped; mean ± standard error over seeds."""
    hops = list(summary[0]["per_hop"]) if summary else []
    head = ["group", "method", "cost", "seeds", "greedy success", *(f"{h}-hop" for h in hops)]
    head += [f"sampled pass@1 (T=1, {spec.samples}/question)", f"pass@{spec.samples}", "train reward rise"]
    diag = [
        (k, name)
        for k, name in (*DIAGNOSTICS, ENTROPY)
        if any(not math.isnan(s["diagnostics"].get(k, (math.nan,))[0]) for s in summary)
    ]
    head += [name for _, name in diag]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for s in summary:
        cost = f"{s['cost']:g}" if s["cost"] else "—"
        cells = [s["group"], s["row"], cost, str(len(s["seeds"])), _fmt(s["success"])]
        cells += [_fmt(s["per_hop"][h]) for h in hops]
        cells += [_fmt(s["sampled_success"]), _fmt(s["pass_at_k"]), _fmt(s["reward_rise"], signed=True)]
        cells += [_fmt(s["diagnostics"][k]) for k, _ in diag]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(diffs: Sequence[float]) -> str:
    """The paired t-test's verdict on per-seed differences (experiments/stats.py): "holds" or "reversed"
    (p < 0.05, t with n − 1 degrees of freedom), "not significant", "tie", "one pair: no test"."""
    return paired_test(diffs).verdict


def check_claims(spec: Spec, results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each claim "better > worse" on held-out success, greedy and sampled, from per-seed paired differences
    (the rows of one seed share prompts, sampling seed and start model): mean ± se and a `verdict`."""
    by_row: dict[str, dict[str, dict[int, float]]] = {m: {} for m in METRICS}
    for r in results.values():
        for metric in METRICS:
            if metric in r.get("eval", {}):
                for name in r["rows"]:
                    by_row[metric].setdefault(name, {})[r["seed"]] = float(r["eval"][metric])
    out = []
    for better, worse in spec.claims:
        claim: dict[str, Any] = {"better": better, "worse": worse}
        for metric in METRICS:
            a, b = by_row[metric].get(better, {}), by_row[metric].get(worse, {})
            diffs = [a[s] - b[s] for s in sorted(set(a) & set(b))]
            key, test = "" if metric == "success" else "sampled_", paired_test(diffs)
            claim.update(
                {f"{key}seeds": len(diffs), f"{key}diff": mean_se(diffs), f"{key}verdict": test.verdict}
            )
            claim[f"{key}test"] = test.as_dict()
        out.append(claim)
    return out


def render_claims(claims: Sequence[Mapping[str, Any]], what: str = "the paper's ordering") -> str:
    """Per claim and metric: the paired difference ± se, t, its degrees of freedom, p and the verdict."""
    head = "difference ± se (t, df, p): verdict"
    lines = [
        f"| {what} | seeds | greedy success: {head} | sampled pass@1: {head} |",
        "|---|---:|---|---|",
    ]
    for c in claims:
        g, sd = PairedTest(**c["test"]).line(), PairedTest(**c["sampled_test"]).line()
        lines.append(f"| {c['better']} > {c['worse']} | {c['seeds']} | {g} | {sd} |")
    return "\n".join(lines)


def render_findings(claims: Sequence[Mapping[str, Any]], steps: int) -> str:
    """What the claims table shows and what it does not, in words generated from its greedy-success tests:
    the orderings that hold (the first row wins), those reversed (it loses), and those with no difference
    shown, each of these with its 95 % interval (how large a real difference could be and go unseen) and the
    seeds a test would need to see a true difference of the size measured (80 % power)."""
    groups: dict[str, list[str]] = {"Wins": [], "No difference shown": [], "Losses": []}
    for c in claims:
        test = PairedTest(**c["test"])
        pair = f"{c['better']} over {c['worse']}"
        figures = test.line().rsplit(":", 1)[0] if test.n >= 2 else test.verdict
        if test.verdict == "holds":
            groups["Wins"].append(f"{pair}, {figures}")
        elif test.verdict == "reversed":
            groups["Losses"].append(f"{pair}, {figures}")
        elif test.verdict == "tie":
            groups["No difference shown"].append(f"{pair}, the same success in each of {test.n} seeds")
        else:
            groups["No difference shown"].append(f"{pair}, {figures}{_power(test)}")
    said = [f"{title}: " + ("; ".join(items) or "none") + "." for title, items in groups.items()]
    return (
        "**What this shows and what it does not** (greedy held-out success, paired per seed, t with n − 1 "
        "degrees of freedom, two-sided 5 %). " + " ".join(said) + " What it does not show: that a "
        "difference inside an interval is absent (these seeds could not see it), or how the orderings "
        f"hold for larger models, other tasks or longer training than {steps} learner steps per run."
    )


def _power(test: PairedTest) -> str:
    """The 95 % interval of a difference not shown, and the seeds that would show one of its size."""
    low, high = test.interval()
    if not math.isfinite(low):
        return ""
    need = pairs_needed(test.sd, abs(test.mean))
    seeds = f"; {need} seeds would show a true difference of {abs(test.mean):.3f}" if need else ""
    return f", 95 % interval [{low:+.3f}, {high:+.3f}]{seeds}"


def best_per_group(spec: Spec, summary: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A tuning grid's choice: per group (a method), the row with the highest mean `spec.select` metric."""
    best: dict[str, Mapping[str, Any]] = {}
    for s in summary:
        m = s[spec.select or "success"][0]
        if not math.isnan(m) and (
            s["group"] not in best or m > best[s["group"]][spec.select or "success"][0]
        ):
            best[s["group"]] = s
    return [
        {"group": g, "row": s["row"], "metric": spec.select, "value": s[spec.select or "success"]}
        for g, s in best.items()
    ]


def render_best(picks: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| method | chosen | by |", "|---|---|---:|"]
    lines += [f"| {p['group']} | {p['row']} | {p['metric']} {_fmt(p['value'])} |" for p in picks]
    return "\n".join(lines)
