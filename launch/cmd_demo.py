"""`treeopsd demo` (what `make demo` runs): the whole system on the embedded default, on any machine.

build the tiny model and warm-start it (cached)  →  evaluate it (greedy, held-out 4–5-hop questions)
→  asynchronous TreeOPSD on a local Ray instance (samplers, backup actor, learner, ZeroMQ weights)
→  evaluate the trained model  →  print both figures with the paired standard error of their difference,
the training reward in windows of 20 steps, the tensorboard command and the summary file.

The default task is the paper table's split (4–5-hop questions, 7 turns): the warm start already answers
nearly every 2-hop question, which left RL nothing to learn on the former 2–4-hop default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from launch.cmd_view import view_command
from storage.durable import write_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("--steps", type=int, default=None, help="learner steps (default: run.steps)")
    parser.add_argument("--run-dir", default=None, help="default: runs/demo-<time>")
    parser.add_argument(
        "--eval-tasks", type=int, default=None, help="held-out tasks to evaluate (run.eval_tasks)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")


def run(args: argparse.Namespace) -> int:
    from configs.schema import ConfigError, load_config
    from experiments.provenance import commit
    from launch.cmd_train import evaluate_split, prepare_run_dir
    from runtime.model_setup import ModelPathError, resolve_model
    from runtime.ray_run import train

    started, code = time.perf_counter(), commit()  # the code as it was when the run began
    extra = list(args.overrides)
    run_dir = args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    extra.append(f"run.run_dir={run_dir}")
    if args.steps is not None:
        extra.append(f"run.steps={args.steps}")
    if args.eval_tasks is not None:
        extra.append(f"run.eval_tasks={args.eval_tasks}")
    try:
        cfg = load_config(args.config, extra)
        print("[1/4] tiny model + warm-start (cached after the first run)", file=sys.stderr)
        model_path = resolve_model(cfg)
    except (ConfigError, ModelPathError) as e:
        print(f"treeopsd demo: {e}", file=sys.stderr)
        return 2
    prepare_run_dir(cfg, resume=False)
    print(f"look at its trees: {view_command(run_dir)}", file=sys.stderr)
    print("[2/4] evaluating the warm-started model", file=sys.stderr)
    before = evaluate_split(cfg, model_path)
    print(
        f"[3/4] asynchronous {cfg.algo.method} training on local Ray, {cfg.run.steps} steps", file=sys.stderr
    )
    summary = train(cfg, model_path)
    print("[4/4] evaluating the trained model", file=sys.stderr)
    after = evaluate_split(cfg, summary["checkpoint"])
    report = demo_report(before, after, summary, Path(run_dir))
    report["command"] = demo_command(args.config)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["commit"] = code
    write_atomic(Path(run_dir, "demo.json"), json.dumps(report, indent=2).encode())
    write_atomic(Path(run_dir, "demo.md"), render_markdown(report).encode())
    print(json.dumps(report, indent=2))
    print("\n" + render_markdown(report).split("\n\n", 2)[2], file=sys.stderr)  # the figures, as in demo.md
    print(f"look at its trees: {report['view']}", file=sys.stderr)
    return 0


def demo_report(before: dict, after: dict, summary: dict, run_dir: Path) -> dict:
    """demo.json: both evaluations, their paired difference, the training reward curve, where things are."""
    from experiments.evaluation import paired_difference

    gain, se, n = paired_difference(before.pop("task_rewards"), after.pop("task_rewards"))
    report = {
        "success_before": before["success"],
        "success_after": after["success"],
        "per_hop_before": before.get("per_hop"),
        "per_hop_after": after.get("per_hop"),
        "success_gain": round(gain, 4),
        "success_gain_paired_se": round(se, 4),
        "paired_tasks": n,
        "answers_before": answer_shares(before),
        "answers_after": answer_shares(after),
        "train_reward_windows": reward_windows(_reward_points(run_dir), WINDOW),
        "steps": summary["steps"],
        "train_s": round(summary["elapsed_s"], 1),
        "run_dir": str(run_dir.resolve()),
        "tensorboard": f"tensorboard --logdir {(run_dir / 'tb').resolve()} --host 127.0.0.1",
        "view": view_command(run_dir),
        "checkpoint": summary["checkpoint"],
    }
    if "sampled_task_rewards" in before and "sampled_task_rewards" in after:
        key = "sampled_task_rewards"
        s_gain, s_se, _ = paired_difference(before.pop(key), after.pop(key))
        report["sampled"] = {
            "samples": after["samples"],
            "success_before": before["sampled_success"],
            "success_after": after["sampled_success"],
            "gain": round(s_gain, 4),
            "gain_paired_se": round(s_se, 4),
        }
    return report


def answer_shares(result: dict) -> dict:
    """Greedy episodes' F1 and the shares that answered and that were malformed (a turn with no call)."""
    finish, n = result.get("finish", {}), max(result.get("n", 0), 1)
    return {
        "f1": result.get("f1", 0.0),
        "answered": result.get("answered", 0.0),
        "malformed": round(finish.get("malformed", 0) / n, 4),
    }


def demo_command(config: str | None) -> str:
    """How the report names its run: `make demo` for the embedded default, else the demo command."""
    if config is None or Path(config).resolve() == Path("configs/default.yaml").resolve():
        return "make demo"
    return f"treeopsd demo --config {config}"


WINDOW = 20  # steps per window of the printed training-reward curve


def reward_windows(points: list[tuple[int, float]], width: int) -> list[float]:
    """Means of the per-batch training reward over consecutive windows of `width` steps (step 1..width,
    ...); a last partial window counts when it holds at least half a window."""
    groups: dict[int, list[float]] = {}
    for step, value in points:
        groups.setdefault((max(step, 1) - 1) // width, []).append(value)
    last = max(groups, default=-1)
    return [
        round(sum(v) / len(v), 4)
        for k, v in sorted(groups.items())
        if k < last or len(v) * 2 >= width or len(groups) == 1
    ]


def _reward_points(run_dir: Path) -> list[tuple[int, float]]:
    """(step, mean leaf reward of the batch) from the run's tensorboard logs (none without them)."""
    from storage.report import load_scalars

    tb = run_dir / "tb"
    return list(load_scalars(tb).get("reward/mean", [])) if tb.is_dir() else []


def render_markdown(report: dict) -> str:
    """RUN_DIR/demo.md: the demo's figures as the README shows them (copied to benchmarks/results/)."""
    se = report["success_gain_paired_se"]
    gain, before, after = report["success_gain"], report["success_before"], report["success_after"]
    ratio = f"{gain / se:.1f}" if se and se > 0 else "n/a"
    hops = sorted(set(report.get("per_hop_before") or {}) & set(report.get("per_hop_after") or {}))
    lines = [
        "# Demo",
        "",
        f"`{report.get('command', 'make demo')}`: {report['steps']} asynchronous TreeOPSD steps in "
        f"{report['train_s']:.0f} s, "
        f"{report.get('wall_s', float('nan')) / 60:.1f} min from start to end"
        + (f", at commit {report['commit']}." if report.get("commit") else "."),
        "",
        f"* held-out success (greedy, {report['paired_tasks']} questions): {before:.3f} before → {after:.3f} "
        f"after, {gain:+.3f} ± {se:.3f} (paired standard error; {ratio} SE)",
    ]
    sampled = report.get("sampled")
    if sampled:
        s_se = sampled["gain_paired_se"]
        s_ratio = f"{sampled['gain'] / s_se:.1f}" if s_se and s_se > 0 else "n/a"
        lines.append(
            f"* held-out success (temperature 1, {sampled['samples']} per question): "
            f"{sampled['success_before']:.3f} before → {sampled['success_after']:.3f} after, "
            f"{sampled['gain']:+.3f} ± {s_se:.3f} (paired over questions; {s_ratio} SE)"
        )
    shares = report.get("answers_before"), report.get("answers_after")
    if all(shares):
        b, a = shares
        lines.append(
            f"* greedy answers: answered {b['answered']:.2f} → {a['answered']:.2f}, malformed "
            f"{b['malformed']:.2f} → {a['malformed']:.2f}, F1 {b['f1']:.3f} → {a['f1']:.3f}"
        )
    for h in hops:
        b, a = report["per_hop_before"][h], report["per_hop_after"][h]
        lines.append(f"* {h}-hop ({b['n']} questions): {b['success']:.3f} → {a['success']:.3f}")
    curve = " → ".join(f"{w:.2f}" for w in report.get("train_reward_windows") or [])
    lines.append(f"* training reward, mean of each {WINDOW} steps: {curve}")
    return "\n".join(lines) + "\n"
