"""PNG plots of a run from its scalar series (`read_scalars(RUN_DIR/tb)`), for `treeopsd report`.

Pure functions of the `{tag: [(step, value), ...]}` dict: nothing here talks to Ray or a live run. Five
figures (laid out in storage/report_layout.py), one titled panel per quantity, every axis labelled:

    reward.png       reward per batch; evaluation success
    staleness.png    version lag (mean and max); stale trees per batch; trees pending in the store
    mismatch.png     μ vs π_prox k3 by version lag and k1; the correction's IS weight and what it clipped or
                     masked; the share of turns cut at the token limit
    throughput.png   per role: sampler tokens/s, idle ratio, wait for weights;
                     learner step seconds, idle ratio, wait for a batch
    minibatches.png  loss, overshoot fraction, mean |s|, KL to target per mini-batch index k (a line per k)

Values logged more than once at a step are plotted as their mean (one point per step); index.md reports
the last value logged. A tag that is absent gives an empty panel that says "no data" (and which tag it
wanted), never an error.
`render_report` also writes `panels.json` ({png name: [panel titles]}) so tests and tools can check the
layout without looking at pixels, and `write_index` writes `index.md` with the final values of key metrics.
Matplotlib is used through `Figure` + the Agg canvas only: no pyplot, no global backend switch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from storage.metrics import read_scalars
from storage.report_layout import (
    FIGURES,
    KEY_METRICS,
    STEP_LABEL,
    FigureSpec,
    Panel,
    figure_specs,
    minibatch_indices,
)

Series = Sequence[tuple[int, float]]
Scalars = Mapping[str, Series]

__all__ = ["FIGURES", "KEY_METRICS", "load_scalars", "minibatch_indices", "render_report", "write_index"]


def _clean(series: Series) -> tuple[list[int], list[float]]:
    """Finite points sorted by step (stable: repeated flushes at one step keep their order)."""
    pts = sorted(((int(s), float(v)) for s, v in series if math.isfinite(float(v))), key=lambda p: p[0])
    return [p[0] for p in pts], [p[1] for p in pts]


def _per_step(steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """One point per step: the mean of the values logged at it (role metrics are flushed several times per
    learner step, and a vertical zigzag at each step hides the trend)."""
    sums: dict[int, list[float]] = {}
    for s, v in zip(steps, values, strict=True):
        sums.setdefault(s, []).append(v)
    return list(sums), [sum(vs) / len(vs) for vs in sums.values()]


def _ema(values: list[float], weight: float) -> list[float]:
    out, acc = [], values[0]
    for v in values:
        acc = weight * acc + (1 - weight) * v
        out.append(acc)
    return out


def _draw_panel(ax: Any, panel: Panel, scalars: Scalars, color_for: Any, legend: bool = True) -> bool:
    """Draws one panel; returns False (and writes "no data") when none of its tags has a point."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel(panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.integer_y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    drawn = 0
    for i, (tag, label) in enumerate(panel.lines):
        steps, values = _per_step(*_clean(scalars.get(tag, ())))
        if not steps:
            continue
        color = color_for(i, len(panel.lines), tag)
        style = {"color": color, "linewidth": 1.6}
        if tag in ("learner/loss", "learner/kl_to_target") and len(panel.lines) > 1:
            style.update(color="black", linestyle="--", linewidth=1.4)
        if len(steps) >= 30:  # long noisy curve: faint raw values, smoothed line on top
            ax.plot(steps, values, color=style["color"], alpha=0.25, linewidth=0.8)
            ax.plot(steps, _ema(values, 0.8), label=label, **style)
        else:  # short run: markers, so one or two points are still visible
            ax.plot(steps, values, label=label, marker="o", markersize=3.5, **style)
        drawn += 1
    if not drawn:
        ax.text(
            0.5,
            0.5,
            panel.missing_note(),
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=11,
            color="0.45",
        )
        ax.set_xticks([])
        ax.set_yticks([])
        return False
    if panel.ylim is not None:
        lo, hi = ax.get_ylim()
        ax.set_ylim(min(lo, panel.ylim[0]), max(hi, panel.ylim[1]))
    ax.grid(True, alpha=0.3)
    if legend and (drawn > 1 or len(panel.lines) > 1):
        ax.legend(fontsize=8, ncol=2 if drawn > 4 else 1, loc="best", framealpha=0.8)
    return True


def _color_for(i: int, n: int, tag: str) -> Any:
    from matplotlib import colormaps

    if tag.startswith("learner/mb") and n > 10:  # many mini-batches: a sequential map reads better
        return colormaps["viridis"](i / max(n - 1, 1))
    return colormaps["tab10"](i % 10)


def render_figure(spec: FigureSpec, scalars: Scalars, path: Path, run_name: str = "") -> list[str]:
    """Writes one PNG; returns its panel titles in reading order."""
    from matplotlib.figure import Figure

    nrows = math.ceil(len(spec.panels) / spec.ncols)
    fig = Figure(figsize=(5.2 * spec.ncols, 3.8 * nrows), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, spec.ncols, squeeze=False).ravel()
    for ax, panel in zip(axes, spec.panels, strict=False):
        _draw_panel(ax, panel, scalars, _color_for, legend=not spec.shared_legend)
    for ax in axes[len(spec.panels) :]:
        ax.set_visible(False)
    if spec.shared_legend:
        labelled: dict[str, Any] = {}
        for ax in axes:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                labelled.setdefault(label, handle)
        if labelled:
            fig.legend(
                list(labelled.values()),
                list(labelled),
                loc="outside lower center",
                ncol=min(len(labelled), 6),
                fontsize=9,
                frameon=False,
            )
    fig.suptitle(f"{spec.title} — {run_name}" if run_name else spec.title, fontsize=13)
    fig.savefig(path, format="png")
    return [p.title for p in spec.panels]


def render_report(scalars: Scalars, out_dir: str | Path, run_name: str = "") -> list[Path]:
    """Renders every figure into `out_dir` (created) and writes `panels.json`; returns the PNG paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths, panels = [], {}
    for spec in figure_specs(scalars):
        path = out / f"{spec.name}.png"
        panels[path.name] = render_figure(spec, scalars, path, run_name)
        paths.append(path)
    (out / "panels.json").write_text(json.dumps(panels, indent=2) + "\n")
    return paths


def _fmt(v: float) -> str:
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


def final_values(scalars: Scalars) -> list[dict[str, Any]]:
    """For each key metric (and each mini-batch's overshoot fraction): final step and value, or None."""
    rows = []
    keys = list(KEY_METRICS) + [
        (f"learner/mb{k}/overshoot_frac", f"overshoot fraction, mini-batch {k}")
        for k in minibatch_indices(scalars)
    ]
    for tag, label in keys:
        steps, values = _clean(scalars.get(tag, ()))
        row: dict[str, Any] = {"tag": tag, "label": label, "points": len(steps)}
        row.update({"step": steps[-1], "value": values[-1]} if steps else {"step": None, "value": None})
        rows.append(row)
    return rows


def write_index(
    scalars: Scalars,
    out_dir: str | Path,
    pngs: Sequence[Path],
    run_name: str = "",
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """`index.md`: the figures (relative links), final values of the key metrics, and `extra` facts."""
    out = Path(out_dir)
    lines = [f"# treeopsd report{': ' + run_name if run_name else ''}", ""]
    panels = json.loads((out / "panels.json").read_text()) if (out / "panels.json").exists() else {}
    lines += ["## Figures", ""]
    for png in pngs:
        titles = panels.get(png.name, [])
        lines.append(f"- [{png.name}]({png.name})" + (f" — {'; '.join(titles)}" if titles else ""))
    lines += [""]
    lines += [
        "## Final values",
        "",
        "| metric | tag | final value | at step | points |",
        "|---|---|---:|---:|---:|",
    ]
    for row in final_values(scalars):
        if row["value"] is None:
            lines.append(f"| {row['label']} | `{row['tag']}` | no data | | 0 |")
        else:
            value, step, n = _fmt(row["value"]), row["step"], row["points"]
            lines.append(f"| {row['label']} | `{row['tag']}` | {value} | {step} | {n} |")
    if extra:
        lines += ["", "## Run", ""]
        lines += [f"- {key}: {value}" for key, value in extra.items()]
    lines += ["", *[f"![{png.stem}]({png.name})" for png in pngs], ""]
    path = out / "index.md"
    path.write_text("\n".join(lines))
    return path


def load_scalars(tb_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """`read_scalars`, re-exported so the command imports one module."""
    return read_scalars(tb_dir)
