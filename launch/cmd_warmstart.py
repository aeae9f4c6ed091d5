"""`treeopsd warmstart`: build the tiny model and SFT it on oracle trajectories of the synthetic KB task.

    treeopsd warmstart                                   # cached under runs/models/tiny-<hash>
    treeopsd warmstart --steps 300 --out /tmp/tiny       # elsewhere, other settings
    treeopsd warmstart --json run.seed=1

With `model.path` set, that model is SFT'd instead, on oracle trajectories written in `env.protocol`
(`treeopsd warmstart model.path=runs/models/smollm2 env.protocol=qwen3 --steps 40`); a missing or
unsupported path is one error line. Otherwise it prints greedy success on the config's eval split before
(the same random-init model the warm-start starts from) and after, per hop count, both measured by
`treeopsd eval`'s evaluator (the sampler's agent loop), and where the model is. A finished warm-start with
the same settings is reused, not retrained.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("--out", default=None, help="model folder (default: <run_dir>/../models/tiny-<hash>)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="SFT steps (default: model.warmstart_steps; 40 with model.path)",
    )
    parser.add_argument(
        "--hops",
        type=int,
        nargs=2,
        default=(2, 3),
        metavar=("MIN", "MAX"),
        help="with model.path: hop counts of the synthetic oracle trajectories (default 2 3)",
    )
    parser.add_argument("--no-before", action="store_true", help="skip evaluating the random-init model")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")


def _success_before(cfg: Any, tasks: list[Any], env: Any) -> dict[str, Any]:
    """Greedy success of the untrained model: the warm-start's own init (same tokenizer texts and seed)."""
    from actors.envs.synthetic_kb import SyntheticKBEnv, tokenizer_texts
    from actors.policy.tiny_model import save_tiny
    from experiments.evaluation import evaluate

    # The warm-start trains its tokenizer on the default KB env; reuse ours when it is that one.
    kb_env = env if (cfg.env.seed, cfg.env.topk) == (0, 2) else SyntheticKBEnv()
    with tempfile.TemporaryDirectory(prefix="treeopsd-init-") as tmp:
        folder = save_tiny(tmp, tokenizer_texts(kb_env), seed=cfg.run.seed)
        return evaluate(cfg, str(folder), tasks, env, progress=cfg.logging.progress)


def run(args: argparse.Namespace) -> int:
    from configs.schema import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        if args.steps is not None and args.steps < 1:
            raise ConfigError(f"--steps = {args.steps} is invalid: expected an integer >= 1")
    except ConfigError as e:
        print(f"treeopsd warmstart: {e}", file=sys.stderr)
        return 2
    if cfg.model.path:  # a pretrained model: SFT it on env.protocol instead of building the tiny one
        return _warmstart_model(args, cfg)
    from actors.sampler_setup import build_env, load_split
    from experiments.evaluation import evaluate, take
    from runtime.model_setup import warm_start_tiny

    if cfg.env.name != "synthetic_kb":
        print("treeopsd warmstart: evaluating on the synthetic KB (what it trains on)", file=sys.stderr)
        cfg = load_config(args.config, [*args.overrides, "env.name=synthetic_kb"])
    env = build_env(cfg)
    tasks = take(load_split(cfg, "eval", env), cfg.run.eval_tasks)
    before = None if args.no_before else _success_before(cfg, tasks, env)
    t0 = time.perf_counter()
    report = warm_start_tiny(cfg, args.out, args.steps, progress=cfg.logging.progress)
    took = time.perf_counter() - t0
    after = evaluate(cfg, report["model_dir"], tasks, env, progress=cfg.logging.progress)
    out = {
        "model_dir": report["model_dir"],
        "cached": bool(report.get("cached")),
        "warmstart_s": round(took, 1),
        "train_s": report.get("train_s"),
        "steps": report.get("settings", {}).get("steps"),
        "success_before": None if before is None else before["success"],
        "success_after": after["success"],
        "per_hop_before": None if before is None else _hops(before),
        "per_hop_after": _hops(after),
        "warmstart_report_success": report.get("success"),  # the warm-start's own greedy evaluator
    }
    print(json.dumps(out, sort_keys=True) if args.json else _text(out))
    return 0


def _warmstart_model(args: argparse.Namespace, cfg: Any) -> int:
    """SFT of `model.path` on oracle trajectories in `env.protocol` (actors/policy/protocol_sft.py)."""
    from pathlib import Path

    from actors.policy.protocol_sft import protocol_warmstart
    from runtime.model_setup import ModelPathError, check_model_path, models_dir_of

    try:
        model = check_model_path(cfg.model.path, models_dir=models_dir_of(cfg))
    except ModelPathError as e:
        print(f"treeopsd warmstart: {e}", file=sys.stderr)
        return 2
    out = args.out or str(models_dir_of(cfg) / f"{Path(model).name}-{cfg.env.protocol}-sft")
    report = protocol_warmstart(
        model,
        out,
        cfg.env.protocol,
        steps=args.steps or 40,
        seed=cfg.run.seed,
        enable_thinking=cfg.env.enable_thinking,
        progress=cfg.logging.progress,
        hops=tuple(args.hops),
    )
    how = "reused" if report["cached"] else f"SFT in {report['seconds']:.1f} s"
    text = f"{how} on the {report['protocol']} protocol: loss {report['loss_first']} -> {report['loss_last']}"
    print(json.dumps(report, sort_keys=True) if args.json else f"{text}\nmodel: {report['model_dir']}")
    return 0


def _hops(result: dict[str, Any]) -> dict[str, float]:
    return {hop: r["success"] for hop, r in result.get("per_hop", {}).items()}


def _text(o: dict[str, Any]) -> str:
    how = "reused a cached warm-start" if o["cached"] else f"trained {o['steps']} steps"
    before = "not measured" if o["success_before"] is None else f"{o['success_before']:.3f}"
    lines = [
        f"warm-start: {how} in {o['warmstart_s']:.1f} s",
        f"success before: {before}   after: {o['success_after']:.3f}   (greedy, eval split)",
    ]
    for hop, s in o["per_hop_after"].items():
        b = "" if o["per_hop_before"] is None else f"{o['per_hop_before'].get(hop, 0.0):.3f} -> "
        lines.append(f"  {hop}-hop: {b}{s:.3f}")
    lines.append(f"model: {o['model_dir']}")
    return "\n".join(lines)
