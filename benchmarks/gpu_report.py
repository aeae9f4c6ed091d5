"""The GPU learner benchmark's results file and its docs/results.md table (`make gpu-bench` runs this last).

    python -m benchmarks.gpu_report OUT/learner_gpu.json OUT/learner_gpu_0.6b.json OUT/learner_gpu_4b.json
        # merges the per-shape runs into OUT/learner_gpu.json (keeping what it already holds for other
        # shapes, the ablations and the profile) and writes OUT/learner_gpu.md beside it

The markdown is what docs/results.md's `<!-- results: benchmarks/results/learner_gpu.md -->` block shows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# the goals on one H200 and the peer figures they are set against (../shared/docs/anchors.md)
GOALS = {"qwen3-0.6b": 20_000, "qwen3-4b": 6_000}
PEERS = {"qwen3-0.6b": "prime-rl: 11.9k on 1×H100", "qwen3-4b": "prime-rl: ~3.4k per GPU on 8×H200"}
PEAK_GOAL_GIB = 80 * 1e9 / 2**30  # "fits 80 GB"


def merge(target: Path, runs: list[Path]) -> dict[str, Any]:
    """`target`'s results with each run's shapes (and its run-wide keys) written over them."""
    out: dict[str, Any] = json.loads(target.read_text()) if target.exists() else {}
    for path in runs:
        out.update(json.loads(path.read_text()))
    return out


def _row(shape: str, layout: str, r: dict[str, Any]) -> str:
    peak = f"{r['peak_gib']:.1f} ({r['model_gib']:.1f})" if "peak_gib" in r else "—"
    rates = f"{r['tokens_per_s']:,} | {r['path_tokens_per_s']:,} | {100 * r['mfu']:.1f} %"
    times = f"{r['step_s']:.2f} | {r['first_step_s']:.1f}"
    return (
        f"| {shape} | {layout} | {rates} | {times} | {peak} | {r['compiles']} | {100 * r['pad_frac']:.1f} % |"
    )


def render(result: dict[str, Any]) -> str:
    """The markdown table of every shape in `result`, then the goals and what else was measured."""
    shapes = [
        k for k in result if k.startswith("qwen3") and isinstance(result[k], dict) and "packed" in result[k]
    ]
    lines = [
        "# Learner on one GPU",
        "",
        f"{result.get('device', '?')}, torch {result.get('torch', '?')}; {result.get('measured', '')}".rstrip(
            "; "
        ),
        "",
        "| model | layout | tok/s | path-equivalent tok/s | MFU | step s | first step s | peak GiB (model) "
        "| compiles | padding |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in shapes:
        lines += [_row(shape, layout, result[shape][layout]) for layout in ("packed", "paths")]
    lines += ["", "Goals (packed tok/s at 16k-token micro-batches; 4B peak ≤ 80 GB = 74.5 GiB):", ""]
    for shape in shapes:
        packed = result[shape]["packed"]
        goal = GOALS.get(shape)
        if goal:
            ok = "met" if packed["tokens_per_s"] >= goal else "not met"
            lines.append(f"* {shape}: {packed['tokens_per_s']:,} ≥ {goal:,}: {ok} ({PEERS[shape]})")
        if shape == "qwen3-4b" and "peak_gib" in packed:
            ok = "met" if packed["peak_gib"] <= PEAK_GOAL_GIB else "not met"
            lines.append(f"* {shape} peak: {packed['peak_gib']:.1f} GiB ≤ {PEAK_GOAL_GIB:.1f} GiB: {ok}")
    for name, r in result.get("ablations", {}).items():
        lines.append(
            f"* ablation, {name}: {r['packed']['tokens_per_s']:,} tok/s, peak {r['packed']['peak_gib']} GiB"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print("usage: python -m benchmarks.gpu_report TARGET.json [RUN.json ...]", file=sys.stderr)
        return 2
    target = Path(argv[0])
    result = merge(target, [Path(p) for p in argv[1:] if Path(p).exists()])
    target.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    target.with_suffix(".md").write_text(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
