"""`make offpolicy-table`, parts 1 and 2 (docs/algorithm.md §11.1): which off-policy correction gives the step
nearest π_prox's on-policy gradient, per turn-KL bucket.

    python -m experiments.offpolicy_drift configs/offpolicy_table.yaml --out benchmarks/results [--quick]

1. the synthetic family (experiments/drift_synthetic.py): 12 cells, L ∈ {256, 1024}, κ ∈ {3e-4, 1e-3, 3e-3},
   random and staleness-aligned drift;
2. the tiny model (experiments/drift_measure.py): μ = the learner's own weights η ∈ `lags` versions back at
   the run's learning rate, turns with thinking spans of `think_tokens` tokens.

Both are pooled into turn-KL buckets (experiments/drift_report.py); the results file names, per bucket, the
best mode and every mode's paired difference to it, and the modes within 0.02 of the best everywhere, which
`auto` must be one of. Part 3, the training confirmation, is `treeopsd experiment` on the same spec.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

DRIFT_KEYS = {
    "chain_steps",
    "lags",
    "think_tokens",
    "modes",
    "batches",
    "trees_per_batch",
    "set",
    "synthetic",
    "quick",
}


def synthetic_cells(section: dict[str, Any]) -> list[dict[str, Any]]:
    from experiments.drift_synthetic import MODES, Cell, Family, measure_cell

    cells = []
    grid = itertools.product((256, 1024), (3e-4, 1e-3, 3e-3), ("random", "aligned"))
    for i, (length, kappa, drift) in enumerate(grid):
        cell = Cell(length, kappa, drift)
        got = measure_cell(
            cell, Family(), i, section.get("batches", 48), section.get("reference_batches", 200)
        )
        name = f"L={length}, κ={kappa:g}, {drift}"
        cells.append({"name": name, "turn_kl": cell.turn_kl, "cosine": {m: got[m] for m in MODES}})
    return cells


def real_cells(spec_path: str, drift: dict[str, Any], models_dir: str, work: Path) -> list[dict[str, Any]]:
    from experiments.drift_measure import measure_length, version_chain, with_settings
    from experiments.grid import load_spec, resolved_config
    from experiments.run import RUN_SETTINGS, warm_start

    spec = load_spec(spec_path, False)
    sets = [f"{k}={json.dumps(v)}" for k, v in (drift.get("set") or {}).items()]
    cfg = resolved_config(spec, spec.rows[0], spec.model_seed(0), (*RUN_SETTINGS, *sets))
    model = warm_start(spec_path, False, spec.model_seed(0), models_dir)
    top = max(drift["think_tokens"])
    chain_cfg = with_settings(cfg, "env", think_tokens=top, max_turn_tokens=top + 48)
    versions = version_chain(chain_cfg, model, work, int(drift["chain_steps"]))
    _progress(f"version chain: {len(versions) - 1} learner steps")
    shape = {"batches": int(drift["batches"]), "trees_per_batch": int(drift["trees_per_batch"])}
    cells = []
    for length in drift["think_tokens"]:
        cfg_l = with_settings(cfg, "env", think_tokens=length, max_turn_tokens=length + 48)
        cells += measure_length(cfg_l, versions, drift["lags"], drift["modes"], shape, work)
        _progress(
            f"think_tokens={length}: " + ", ".join(f"η={c['lag']} turn KL {c['turn_kl']:.3f}" for c in cells)
        )
    return cells


def _progress(line: str) -> None:
    print(f"offpolicy_drift: {time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def load_drift(spec_path: str, quick: bool) -> dict[str, Any]:
    """The spec's `drift` section (its `quick` values applied), checked: one line naming what is wrong."""
    try:
        drift = yaml.safe_load(Path(spec_path).read_text())["drift"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise ValueError(f"{spec_path}: no usable drift section ({e})") from None
    if not isinstance(drift, dict) or set(drift) - DRIFT_KEYS:
        raise ValueError(f"{spec_path}: drift may set {', '.join(sorted(DRIFT_KEYS))} only")
    return {**drift, **(drift.get("quick") or {})} if quick else drift


def run(args: argparse.Namespace) -> dict[str, Any]:
    from experiments import provenance
    from experiments.drift_report import bucket_table, qualifying

    stamp = provenance.require_clean(args.allow_dirty)  # before anything runs
    drift = load_drift(args.spec, args.quick)
    t0 = time.time()
    synthetic = synthetic_cells(drift.get("synthetic") or {})
    _progress("synthetic family measured")
    real = real_cells(args.spec, drift, args.models_dir, Path(args.work))
    tables = {"synthetic": bucket_table(synthetic), "tiny_model": bucket_table(real)}
    from configs.algo import AlgoConfig

    return {
        "spec": args.spec,
        "quick": args.quick,
        **stamp,
        "date": provenance.now(),
        "cpu": provenance.cpu_model(),
        "cpus": os.cpu_count(),
        "wall_s": round(time.time() - t0, 1),
        "drift": drift,
        "cells": {"synthetic": synthetic, "tiny_model": real},
        "buckets": tables,
        "qualifying": {k: qualifying(v) for k, v in tables.items()},
        "auto": AlgoConfig().resolved(off_policy=True)["rollout_correction"],
    }


def rerender(path: Path, allow_dirty: bool) -> dict[str, Any]:
    """An earlier results file with today's rendering; its own commit and date stay, the rendering's are
    added (`rerendered`)."""
    import json

    from experiments import provenance

    stamp = provenance.require_clean(allow_dirty)
    results: dict[str, Any] = json.loads(path.read_text())
    results["rerendered"] = {**stamp, "date": provenance.now()}
    return results


def main(argv: list[str] | None = None) -> int:
    from experiments import provenance
    from experiments.drift_render import render

    parser = argparse.ArgumentParser(prog="python -m experiments.offpolicy_drift")
    parser.add_argument("spec")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--models-dir", default="runs/models")
    parser.add_argument("--work", default="runs/offpolicy_drift")
    parser.add_argument("--quick", action="store_true", help="the drift section's quick values")
    parser.add_argument(
        "--allow-dirty", action="store_true", help="run from uncommitted code (said in the results)"
    )
    parser.add_argument(
        "--rerender", action="store_true", help="measures nothing: --out's results file rendered again"
    )
    args = parser.parse_args(argv)
    out, tag = Path(args.out), "offpolicy_drift" + ("_quick" if args.quick else "")
    try:
        results = rerender(out / f"{tag}.json", args.allow_dirty) if args.rerender else run(args)
    except (ValueError, OSError, provenance.DirtyTree) as e:
        print(f"offpolicy_drift: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    provenance.write_json(out / f"{tag}.json", results)
    (out / f"{tag}.md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
