"""The markdown of `make offpolicy-table`'s parts 1–2 (experiments/offpolicy_drift.py): provenance, the two
bucket tables and a paragraph generated from their numbers (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from experiments.drift_report import TOLERANCE, render_buckets


def render(results: Mapping[str, Any]) -> str:
    drift = results["drift"]
    quick = " --quick" if results["quick"] else ""
    head = [
        "# offpolicy_drift",
        "",
        f"`python -m experiments.offpolicy_drift {results['spec']}{quick}` — commit {results['commit']}"
        f"{_dirty(results)}, {results['date']}, {results['cpus']} CPUs ({results['cpu']}), "
        f"{results['wall_s'] / 60:.1f} min wall.{_rerendered(results)}",
        "",
        "Claim stated before the runs (configs/offpolicy_table.yaml): `auto` — "
        f"`{results['auto']}` — is within {TOLERANCE} of the best mode's expected batch cosine to π_prox's "
        "on-policy gradient in every turn-KL bucket. Cosine: of one batch's gradient (the production batch "
        f"size, {drift['trees_per_batch']} trees on the tiny model) to the mean on-policy gradient; relative "
        "bias²: ‖E g − E g_on‖² / ‖E g_on‖², unbiased over independent batches (it can be negative); paired "
        "differences over the same μ batches, t with n − 1 degrees of freedom.",
        "",
    ]
    body = [
        render_buckets(
            results["buckets"]["synthetic"], "Part 1: the synthetic family (experiments/drift_synthetic.py)"
        ),
        "",
        render_buckets(
            results["buckets"]["tiny_model"],
            f"Part 2: the tiny model, μ = its own weights η ∈ {drift['lags']} versions back "
            f"({drift['chain_steps']} real learner steps), thinking spans of {drift['think_tokens']} tokens, "
            f"{drift['batches']} batches per cell",
        ),
        "",
        _cells_line(results["cells"]["tiny_model"]),
        "",
        conclusion(results),
    ]
    return "\n".join(head + body) + "\n"


def _rerendered(results: Mapping[str, Any]) -> str:
    again = results.get("rerendered")
    if not again:
        return ""
    return f" Re-rendered at commit {again['commit']}{_dirty(again)}, {again['date']}."


def _dirty(results: Mapping[str, Any]) -> str:
    return "" if results["clean"] else f" (**{results['note']}**)"


def _cells_line(cells: list[Mapping[str, Any]]) -> str:
    parts = [
        f"{c['name']}: {c['tokens_per_turn']:.0f} tokens a turn, turn KL {c['turn_kl']:.3f}" for c in cells
    ]
    return "Measured per cell: " + "; ".join(parts) + "."


def conclusion(results: Mapping[str, Any]) -> str:
    """What the tables show and what they do not, from their numbers."""
    auto, lines = results["auto"], []
    for part, title in (("synthetic", "synthetic family"), ("tiny_model", "tiny model")):
        table, ok = results["buckets"][part], results["qualifying"][part]
        if not table:
            continue
        bests = ", ".join(f"{b['bucket']}: {b['best']}" for b in table)
        held = "holds" if auto in ok else "does not hold"
        lines.append(
            f"On the {title} the best mode per bucket is {bests}; the modes within {TOLERANCE} of the best "
            f"in every bucket are {', '.join(ok) or 'none'}, so the claim for `{auto}` {held} there."
        )
        if auto not in ok:
            lines.append(_shortfalls(table, auto))
        worst = _worst(table)
        if worst is not None:
            lines.append(
                f"The largest loss is {worst[0]}'s in bucket {worst[1]}: {worst[2]:.3f} below the best "
                "cosine."
            )
    lines.append(
        "What this does not show: that a corrected step trains better over many steps (the training "
        "confirmation, offpolicy_table.md, asks that); buckets hold only the drifts the cells reached; one "
        "model size."
    )
    return " ".join(lines)


def _shortfalls(table: list[Mapping[str, Any]], mode: str) -> str:
    """Where `mode` falls short of the tolerance, and whether each shortfall is significant (5 %, paired)."""
    short = [
        (b["bucket"], r["vs_best"])
        for b in table
        for r in b["modes"]
        if r["mode"] == mode and not r["qualifies"] and r["vs_best"] is not None
    ]
    named = "; ".join(
        f"{bucket}: {t['mean']:+.3f} ± {t['se']:.3f} (p = {t['p']:.3f}, {t['n']} batches)"
        for bucket, t in short
    )
    significant = sum(t["p"] < 0.05 for _, t in short)
    return (
        f"`{mode}` falls short in {len(short)} bucket(s) ({named}), {significant} of them significant at 5 %"
        + (": there these batches cannot tell the modes apart." if significant == 0 else ".")
    )


def _worst(table: list[Mapping[str, Any]]) -> tuple[str, str, float] | None:
    gaps = [
        (
            r["mode"],
            b["bucket"],
            next(x["cosine"] for x in b["modes"] if x["mode"] == b["best"]) - r["cosine"],
        )
        for b in table
        for r in b["modes"]
    ]
    return max(gaps, key=lambda g: g[2]) if gaps else None
