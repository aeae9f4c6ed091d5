"""The off-policy table's statistics (pure; `make offpolicy-table`, docs/algorithm.md §11.1): per turn-KL
bucket, each correction mode's expected batch-gradient cosine to π_prox's on-policy gradient and its squared
bias, with paired mode-vs-mode differences, and which mode `auto` may be by that evidence.

A cell is one (thinking length L, lag η) of the real experiment, or one (L, κ, drift) of the synthetic family.
It holds, per mode, one cosine per μ batch (the same batches for every mode, so modes are compared pairwise),
and its measured turn KL. Cells are pooled into the bucket of their mean turn KL:

    ≤ 0.1 · 0.1–0.3 · 0.3–1 · > 1     (with C = 2 the product keeps 0.98 · 0.89 · 0.65 · < 0.65 of its mass)

A mode qualifies in a bucket when its mean cosine is within TOLERANCE of the bucket's best; the default must
qualify in every bucket that has cells.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.stats import paired_test

BUCKETS = ((0.0, 0.1, "≤ 0.1"), (0.1, 0.3, "0.1–0.3"), (0.3, 1.0, "0.3–1"), (1.0, math.inf, "> 1"))
TOLERANCE = 0.02


def bucket_of(turn_kl: float) -> str:
    for lo, hi, name in BUCKETS:
        if lo <= turn_kl <= hi if lo == 0.0 else lo < turn_kl <= hi:
            return name
    raise ValueError(f"turn KL {turn_kl} is not a number ≥ 0")


def bucket_table(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per bucket with cells: the cells' names, per mode the pooled mean cosine, mean relative bias² (where
    the cells carry it), the paired difference to the bucket's best mode (a t-test over the pooled
    batches), and whether the mode is within TOLERANCE of the best."""
    out = []
    for _, _, name in BUCKETS:
        members = [c for c in cells if bucket_of(c["turn_kl"]) == name]
        if not members:
            continue
        modes = list(members[0]["cosine"])
        pooled = {m: [x for c in members for x in c["cosine"][m]] for m in modes}
        means = {m: sum(v) / len(v) for m, v in pooled.items()}
        best = max(modes, key=lambda m: means[m])
        rows = []
        for m in modes:
            diffs = [a - b for a, b in zip(pooled[m], pooled[best], strict=True)]
            bias = [c["rel_sq_bias"][m] for c in members if "rel_sq_bias" in c]
            rows.append(
                {
                    "mode": m,
                    "cosine": means[m],
                    "vs_best": paired_test(diffs).as_dict() if m != best else None,
                    "rel_sq_bias": sum(bias) / len(bias) if bias else math.nan,
                    "qualifies": means[best] - means[m] <= TOLERANCE,
                }
            )
        kls = [c["turn_kl"] for c in members]
        out.append(
            {
                "bucket": name,
                "cells": [c["name"] for c in members],
                "turn_kl": kls,
                "best": best,
                "modes": rows,
            }
        )
    return out


def qualifying(table: Sequence[Mapping[str, Any]]) -> list[str]:
    """The modes within TOLERANCE of the best in every bucket (in the table's mode order)."""
    if not table:
        return []
    modes = [r["mode"] for r in table[0]["modes"]]
    return [
        m for m in modes if all(next(r for r in b["modes"] if r["mode"] == m)["qualifies"] for b in table)
    ]


def render_buckets(table: Sequence[Mapping[str, Any]], title: str) -> str:
    """Markdown: one line per bucket and mode."""
    lines = [
        f"**{title}**",
        "",
        "| turn KL bucket | cells (mean turn KL) | mode | batch cosine to π_prox's gradient | relative bias² "
        "| paired difference to the bucket's best (± se, t, df, p) | within 0.02 |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for b in table:
        cells = ", ".join(f"{n} ({k:.2f})" for n, k in zip(b["cells"], b["turn_kl"], strict=True))
        for r in b["modes"]:
            vs = "best" if r["vs_best"] is None else _test_line(r["vs_best"])
            bias = "—" if math.isnan(r["rel_sq_bias"]) else f"{r['rel_sq_bias']:+.4f}"
            mark = "yes" if r["qualifies"] else "no"
            lines.append(
                f"| {b['bucket']} | {cells} | {r['mode']} | {r['cosine']:.3f} | {bias} | {vs} | {mark} |"
            )
    return "\n".join(lines)


def _test_line(t: Mapping[str, Any]) -> str:
    if t["n"] < 2:
        return f"{t['mean']:+.4f} (one batch)"
    return (
        f"{t['mean']:+.4f} ± {t['se']:.4f} (t = {t['t']:.2f}, df {t['df']}, p = {t['p']:.3f}): {t['verdict']}"
    )
