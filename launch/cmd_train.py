"""`treeopsd train`: asynchronous (default) or synchronous training on Ray.

    treeopsd train --config configs/default.yaml --steps 20 --run-dir runs/x [--resume] [--sync] [k=v ...]

The run directory holds everything: config.yaml, store/ (the replay store), checkpoints/, tb/ (tensorboard),
summary.json. Left at runs/default (nobody chose one), each run gets its own runs/<run.name>-<time>, and
--resume picks the newest of them. `--resume` continues from the newest checkpoint: the store is rewound
to the checkpoint's consumed watermark, so no batch is trained twice and none skipped.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("--steps", type=int, default=None, help="learner steps to reach (run.steps)")
    parser.add_argument("--run-dir", default=None, help="run directory (run.run_dir)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--sync", action="store_true", help="synchronous baseline (run.mode=sync)")
    parser.add_argument("--eval", action="store_true", help="evaluate before and after training")
    parser.add_argument("--eval-tasks", type=int, default=None, help="tasks for --eval (run.eval_tasks)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")


def config_from_args(args: argparse.Namespace) -> Any:
    from configs.schema import load_config

    cfg = load_config(args.config, _overrides(args))
    chosen = args.run_dir is not None or any(o.startswith("run.run_dir=") for o in args.overrides)
    run_dir = choose_run_dir(
        cfg.run.run_dir, cfg.run.name, chosen, args.resume, time.strftime("%Y%m%d-%H%M%S")
    )
    if run_dir == cfg.run.run_dir:
        return cfg
    return load_config(args.config, [*_overrides(args), f"run.run_dir={run_dir}"])


UNCHOSEN_RUN_DIR = "runs/default"  # the schema's and the embedded config's run.run_dir


def choose_run_dir(
    run_dir: str, name: str, chosen: bool, resume: bool, stamp: str, unchosen: str = UNCHOSEN_RUN_DIR
) -> str:
    """`run.run_dir`, unless nobody chose it (still runs/default): then a fresh run gets its own
    runs/<name>-<stamp>, so a second `treeopsd train` never meets the first one's directory, and --resume
    continues the newest runs/<name>-* that holds a run (runs/default itself when none does)."""
    if chosen or run_dir != unchosen:
        return run_dir
    parent = Path(run_dir).parent
    if not resume:
        return str(parent / f"{name}-{stamp}")
    runs = sorted(p for p in parent.glob(f"{name}-*") if (p / "config.yaml").exists())
    return str(runs[-1]) if runs else run_dir


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = list(args.overrides)
    if args.steps is not None:
        extra.append(f"run.steps={args.steps}")
    if args.run_dir is not None:
        extra.append(f"run.run_dir={args.run_dir}")
    if getattr(args, "sync", False):
        extra.append("run.mode=sync")
    if getattr(args, "no_progress", False):
        extra.append("logging.progress=false")
    if getattr(args, "eval_tasks", None) is not None:
        extra.append(f"run.eval_tasks={args.eval_tasks}")
    return extra


def prepare_run_dir(cfg: Any, resume: bool) -> Path:
    """Refuses to mix two runs: a fresh run needs an empty or new directory, --resume an existing run."""
    import yaml

    from configs.schema import to_dict
    from storage.durable import write_atomic

    run_dir = Path(cfg.run.run_dir)
    has_run = (run_dir / "config.yaml").exists()
    if has_run and not resume:
        raise SystemExit(f"treeopsd train: {run_dir} already holds a run; pass --resume or a new --run-dir")
    if resume and not has_run:
        raise SystemExit(f"treeopsd train: --resume given but {run_dir} holds no run (no config.yaml)")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
    return run_dir


def check_before_start(cfg: Any) -> None:
    """What can be known wrong before Ray starts, raised as one line (ConfigError or ValueError)."""
    from configs.schema import ConfigError
    from storage.tracking import check_trackers

    if cfg.run.sampler_lag:  # a controlled lag needs the in-process wiring; on Ray the lag is what it is
        raise ConfigError(
            f"run.sampler_lag = {cfg.run.sampler_lag} is invalid: expected 0 for a run on Ray (it holds "
            "back the in-process samplers of `treeopsd experiment`; here set store.eta)"
        )
    check_trackers(cfg.logging)
    if cfg.env.harness:  # importable here, before Ray starts, or one line naming env.harness
        from actors.external.discovery import check_ports
        from actors.external.trees import load_harness

        load_harness(cfg.env.harness)
        check_ports(cfg.env.agent_host, cfg.env.agent_port, cfg.sampler.num_samplers)  # P .. P + N - 1
    if cfg.env.name == "gym":  # the factory imports (in env.python, if set) and the tasks load here
        from actors.envs.gym import check_gym_env

        check_gym_env(cfg.env)


def run(args: argparse.Namespace) -> int:
    from configs.schema import ConfigError
    from launch.cmd_view import view_command
    from runtime.model_setup import ModelPathError, resolve_model

    try:
        cfg = config_from_args(args)
        check_before_start(cfg)
        model_path = resolve_model(cfg, progress=cfg.logging.progress)
    except (ConfigError, ModelPathError, ValueError) as e:
        print(f"treeopsd train: {e}", file=sys.stderr)
        return 2
    prepare_run_dir(cfg, args.resume)
    print(f"look at its trees: {view_command(cfg.run.run_dir)}", file=sys.stderr)
    before = evaluate_split(cfg, model_path) if args.eval else None
    from runtime.decisions import RoleFailed
    from runtime.learner_group import LearnerRankError
    from runtime.ray_run import ray_training
    from runtime.signals import Abort

    again = resume_command(sys.argv[1:], cfg.run.run_dir)
    try:
        with ray_training(cfg, model_path, resume=args.resume) as driver:
            summary = driver.finish(driver.run(cfg.run.steps))
    except ConfigError as e:  # e.g. a pool that no node of the cluster provides
        print(f"treeopsd train: {e}", file=sys.stderr)
        return 2
    except (LearnerRankError, RoleFailed) as e:  # restarts used up: the run stops, --resume continues it
        print(f"treeopsd train: {e}\ncontinue from the last checkpoint with: {again}", file=sys.stderr)
        return 1
    except Abort as e:  # a second SIGINT/SIGTERM: 128 + the signal number (runtime/signals.py)
        print(f"treeopsd train: {e}\ncontinue from the last checkpoint with: {again}", file=sys.stderr)
        return e.exit_code
    if summary.get("stopped_by"):  # a first SIGINT/SIGTERM: stopped cleanly, exit 0
        print(
            f"treeopsd train: stopped by {summary['stopped_by']} at step {summary['steps']} of "
            f"{cfg.run.steps}; checkpoint {summary['checkpoint']}\ncontinue with: {again}",
            file=sys.stderr,
        )
    if args.eval:
        from launch.cmd_export import hf_folder  # a sharded checkpoint is exported first

        after = evaluate_split(cfg, hf_folder(summary["checkpoint"]))
        summary["eval_before"], summary["eval_after"] = before, after
    print(json.dumps(summary, indent=2, default=str))
    return 0


def evaluate_split(cfg: Any, model_path: str) -> dict[str, Any]:
    from actors.sampler_setup import build_env, load_split
    from experiments.evaluation import evaluate, take
    from runtime.retrieval_actor import local_retrieval

    with local_retrieval(cfg) as cfg:  # the run's own service lives only inside `train`
        env = build_env(cfg)
        tasks = take(load_split(cfg, "eval", env), cfg.run.eval_tasks)
        return evaluate(
            cfg,
            model_path,
            tasks,
            env,
            progress=cfg.logging.progress,
            samples=cfg.run.eval_samples,
            workers=cfg.run.eval_workers,  # nothing else runs meanwhile: every core may evaluate
        )


def resume_command(argv: Sequence[str], run_dir: str) -> str:
    """The command line that continues this run: the same arguments with --resume (and the run directory)."""
    args = [a for a in argv if a != "--resume"]
    args = args[1:] if args[:1] == ["train"] else args  # sys.argv[1:] starts with the subcommand
    if not any(a == "--run-dir" or a.startswith(("--run-dir=", "run.run_dir=")) for a in args):
        args += ["--run-dir", run_dir]
    return shlex.join(["treeopsd", "train", "--resume", *args])
