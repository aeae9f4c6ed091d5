"""Learning curves of an experiment grid: one panel per row group (training reward per step, mean over seeds
with a ±1 standard-error band, moving average), plus a bar panel of held-out success per row."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.grid import Spec
from experiments.report import mean_se


def smooth(xs: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over up to `window` values (NaNs skipped)."""
    out = []
    for i in range(len(xs)):
        part = [x for x in xs[max(0, i - window + 1) : i + 1] if not math.isnan(x)]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


def row_curve(spec: Spec, row: str, results: Mapping[str, Mapping[str, Any]], key: str = "reward/mean"):
    """(steps, mean, se) of a row's smoothed per-step curve over its seeds; None without curves."""
    window = max(1, spec.steps // 10)
    curves = [
        smooth(r["curves"][key], window)
        for r in results.values()
        if row in r["rows"] and r.get("curves", {}).get(key)
    ]
    if not curves:
        return None
    n = min(map(len, curves))
    stats = [mean_se([c[i] for c in curves]) for i in range(n)]
    return list(range(1, n + 1)), [m for m, _ in stats], [0.0 if math.isnan(s) else s for _, s in stats]


def plot_curves(
    spec: Spec, results: Mapping[str, Mapping[str, Any]], summary: Sequence[Mapping[str, Any]], path: Path
) -> None:
    """`summary`: experiments.report.rows_summary of the same results (the bar panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r.group for r in spec.rows))
    cols = min(3, len(groups) + 1)
    rows = math.ceil((len(groups) + 1) / cols)
    fig, grid = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[len(groups) + 1 :]:
        ax.set_visible(False)
    for ax, group in zip(axes, groups, strict=False):
        for row in (r for r in spec.rows if r.group == group):
            got = row_curve(spec, row.name, results)
            if got is None:
                continue
            steps, mean, se = got
            line = ax.plot(steps, mean, label=row.name, linewidth=1.4)[0]
            lo = [m - s for m, s in zip(mean, se, strict=True)]
            hi = [m + s for m, s in zip(mean, se, strict=True)]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.18, linewidth=0)
        ax.set_title(f"{group}: training reward (moving avg)")
        ax.set_xlabel("learner step")
        ax.set_ylabel("mean leaf reward")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7, loc="lower right")
    ax = axes[len(groups)]
    means = [s["success"][0] for s in summary]
    errs = [0.0 if math.isnan(s["success"][1]) else s["success"][1] for s in summary]
    ys = range(len(summary))
    ax.barh(list(ys), [0.0 if math.isnan(m) else m for m in means], xerr=errs, color="tab:blue", alpha=0.7)
    ax.set_yticks(list(ys), [s["row"] for s in summary], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("greedy success, held-out split")
    ax.set_title("held-out success (± s.e.)")
    ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{spec.name}: seeds {list(spec.seeds)}, {spec.steps} steps per run", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
