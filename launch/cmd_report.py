"""`treeopsd report RUN_DIR [--out DIR]`: PNG plots of a run from its tensorboard logs.

Reads the scalars in RUN_DIR/tb (written by `storage.metrics.TensorboardSink`) and writes, into
RUN_DIR/report/ unless --out says otherwise: reward.png, staleness.png, throughput.png, minibatches.png,
panels.json (the panel titles of each PNG) and index.md (the figures and the final values of the key
metrics, plus the success before/after training from demo.json or summary.json when the run has one).
A tag the run never logged gives a "no data" panel. Exit 2 when RUN_DIR has no tb/ directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds tb/ with event files)")
    parser.add_argument("--out", default=None, metavar="DIR", help="where to write (default RUN_DIR/report)")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"treeopsd report: ignoring {path}: {e}", file=sys.stderr)
        return {}
    return data if isinstance(data, dict) else {}


def _success(value: Any) -> float | None:
    if isinstance(value, dict):
        value = value.get("success")
    return float(value) if isinstance(value, int | float) else None


def run_facts(run_dir: Path) -> tuple[dict[str, Any], list[tuple[int, float]]]:
    """Facts for index.md and the before/after success points, from demo.json and summary.json."""
    demo, summary = _read_json(run_dir / "demo.json"), _read_json(run_dir / "summary.json")
    facts: dict[str, Any] = {}
    steps = demo.get("steps", summary.get("steps"))
    before = _success(demo.get("success_before", summary.get("eval_before")))
    after = _success(demo.get("success_after", summary.get("eval_after")))
    for key, value in (
        ("steps", steps),
        ("mode", summary.get("mode")),
        ("train seconds", demo.get("train_s", summary.get("elapsed_s"))),
        ("success before training", before),
        ("success after training", after),
        ("sampler failures", summary.get("sampler_failures")),
        ("sampler restarts", summary.get("sampler_restarts")),
        ("checkpoint", demo.get("checkpoint", summary.get("checkpoint"))),
    ):
        if value is not None:
            facts[key] = f"{value:.4g}" if isinstance(value, float) else value
    points = []
    if before is not None:
        points.append((0, before))
    if after is not None and isinstance(steps, int):
        points.append((steps, after))
    return facts, points


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    tb = run_dir / "tb"
    if not tb.is_dir():
        what = "does not exist" if not run_dir.exists() else "has no tb/ directory (no tensorboard logs)"
        print(
            f"treeopsd report: {run_dir} {what}; pass the run directory that `treeopsd train` or "
            "`treeopsd demo` wrote (its run.run_dir)",
            file=sys.stderr,
        )
        return 2

    from storage.report import load_scalars, render_report, write_index

    scalars = load_scalars(tb)
    if not scalars:
        print(f"treeopsd report: no scalars in {tb} yet; every panel will say 'no data'", file=sys.stderr)
    facts, success_points = run_facts(run_dir)
    if success_points:
        scalars = {**scalars, "demo/success": success_points}
    out = Path(args.out) if args.out else run_dir / "report"
    if out.exists() and not out.is_dir():
        print(f"treeopsd report: --out {out} is a file; pass a directory (new or existing)", file=sys.stderr)
        return 2
    name = run_dir.resolve().name
    pngs = render_report(scalars, out, run_name=name)
    index = write_index(scalars, out, pngs, run_name=name, extra=facts)
    for path in (*pngs, out / "panels.json", index):
        print(path)
    return 0
