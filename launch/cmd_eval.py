"""`treeopsd eval`: greedy success / EM / F1 of a model (with --samples K also sampled pass@1 and pass@K),
per dataset (and per hop count on the synthetic KB). The evaluation itself is experiments/evaluation.py.

    treeopsd eval --model runs/models/tiny-XXXX                     # the config's eval split (synthetic KB)
    treeopsd eval --model M --data hotpot_dev.json --data musique.jsonl env.name=multihop_qa --limit 200
    treeopsd eval --model M --json                                  # one JSON object on stdout

Each task is one greedy episode of the sampler's own agent loop (`run_episodes`, the same tool parsing,
limits and token-in/token-out bookkeeping as training rollouts), batched `--batch` episodes per backend
call. `--data` files are read by the loader of `env.name` (multihop_qa: any supported QA format, searched
over `env.corpus` or, without one, the file's own paragraphs; deep_research: BrowseComp-Plus queries over
`env.corpus`). success = mean reward (the rewards here are 0/1 exact match); EM/F1 use the official
answer normalization and count 0 for episodes that never answer.

The trainer calls `evaluate(cfg, model_path, tasks, env, backend)` for its success before/after.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.evaluation import evaluate, take
from experiments.retrieval_recall import attach_qrels
from launch.cli import positive_int


class EvalDataError(ValueError):
    """An evaluation data file that cannot be used; the message names the file."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder or .gguf (imported once; default: model.path / tiny)"
    )
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("--data", action="append", default=None, help="a local dataset file (repeatable)")
    parser.add_argument("--limit", type=positive_int, default=None, help="at most N tasks per dataset")
    parser.add_argument("--batch", type=int, default=32, help="episodes per backend call (default 32)")
    parser.add_argument(
        "--samples",
        type=int,
        default=0,
        help="also K sampled episodes per task at temperature 1 (pass@1, pass@K)",
    )
    parser.add_argument(
        "--qrels", default=None, help="TREC qrels: also report retrieval recall (gold docs retrieved)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")


def eval_sets(cfg: Any, data: Sequence[str]) -> list[tuple[str, Any, list[Any]]]:
    """(label, env, tasks) per dataset: the config's eval split, or one per `--data` file."""
    from actors.sampler_setup import build_env, load_split

    missing = [p for p in data if not Path(p).is_file()]
    if missing:  # the file first: naming env.name for a mistyped path sends the user the wrong way
        raise EvalDataError(f"--data {missing[0]}: no such file")
    if cfg.env.name == "synthetic_kb":
        if data:
            raise EvalDataError(
                "--data needs env.name=multihop_qa or env.name=deep_research "
                "(the synthetic KB generates its own eval split)"
            )
        env = build_env(cfg)
        tasks = take(load_split(cfg, "eval", env), cfg.run.eval_tasks)
        return [("synthetic_kb", env, tasks)]
    files = list(data) or [f for f in (cfg.env.eval_data or cfg.env.data,) if f]
    if not files:
        raise EvalDataError(f"env.name={cfg.env.name}: pass --data FILE (or set env.eval_data)")
    shared: dict[str, Any] = {}  # one corpus index for all files when env.corpus is set
    out: list[tuple[str, Any, list[Any]]] = []
    for path in files:
        label, env, tasks = _load_file(cfg, path, shared)
        labels = {x[0] for x in out}
        out.append((f"{label} ({Path(path).name})" if label in labels else label, env, tasks))
    return out


def _load_file(cfg: Any, path: str, shared: dict[str, Any]) -> tuple[str, Any, list[Any]]:
    from actors.envs import load_tasks, make_env

    if not Path(path).is_file():
        raise EvalDataError(f"--data {path}: no such file")
    passages: list[Any] = []
    try:
        if cfg.env.name == "multihop_qa":
            from actors.envs.multihop_qa import load_dataset

            ds = load_dataset(path)
            label, tasks, passages = ds.name, ds.tasks, ds.passages
        else:
            tasks = load_tasks(cfg.env.name, "eval", path=path)
            label = tasks[0].dataset if tasks else cfg.env.name
    except (ValueError, OSError, KeyError) as e:  # DatasetFormatError is a ValueError naming file and record
        msg = str(e)
        raise EvalDataError(msg if path in msg else f"--data {path}: {msg}") from None
    if not tasks:
        raise EvalDataError(f"--data {path}: holds no questions (a corpus file? pass it as env.corpus)")
    if cfg.env.corpus is not None:
        return label, _corpus_env(cfg, shared), tasks
    if not passages:
        raise EvalDataError(f"--data {path}: the file ships no passages to search; set env.corpus=FILE")
    # No corpus given: search the dataset's own paragraphs (HotpotQA/2Wiki/MuSiQue ship them).
    env = make_env("multihop_qa", corpus=passages, topk=cfg.env.topk, max_turns=cfg.env.max_turns)
    return label, env, tasks


def _corpus_env(cfg: Any, shared: dict[str, Any]) -> Any:
    """The env over `env.corpus`, built once for all --data files."""
    from actors.sampler_setup import build_env

    if "env" not in shared:
        try:
            shared["env"] = build_env(cfg)
        except (ValueError, OSError, KeyError) as e:
            msg, corpus = str(e), str(cfg.env.corpus)
            raise EvalDataError(msg if corpus in msg else f"env.corpus {corpus}: {msg}") from None
    return shared["env"]


def _qrels(path: str) -> dict[str, dict[str, int]]:
    from actors.envs.deep_research import load_qrels

    try:
        return load_qrels(path)
    except (ValueError, OSError) as e:
        msg = str(e)
        raise EvalDataError(msg if path in msg else f"--qrels {path}: {msg}") from None


# ---- the command ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from configs.schema import ConfigError, load_config
    from runtime.model_setup import ModelPathError
    from runtime.retrieval_actor import local_retrieval

    try:
        cfg = load_config(args.config, args.overrides)
        with local_retrieval(cfg) as cfg:  # env.retriever = service without a URL: served from here
            return _evaluate(args, cfg)
    except (ConfigError, ModelPathError, EvalDataError) as e:
        print(f"treeopsd eval: {e}", file=sys.stderr)
        return 2


def _evaluate(args: argparse.Namespace, cfg: Any) -> int:
    from runtime.model_setup import build_policy, check_model_path, models_dir_of, resolve_model

    model = check_model_path(args.model, "--model", models_dir_of(cfg)) if args.model else None
    sets = [(name, env, take(tasks, args.limit)) for name, env, tasks in eval_sets(cfg, args.data or [])]
    if args.qrels:  # recall against these gold documents (BrowseComp-Plus queries carry their own)
        qrels = _qrels(args.qrels)
        sets = [(name, env, attach_qrels(tasks, qrels)) for name, env, tasks in sets]
    model = model or resolve_model(cfg, progress=cfg.logging.progress)
    backend = build_policy(cfg, model, seed=cfg.run.seed, greedy=True)
    try:
        results = {
            label: evaluate(cfg, model, tasks, env, backend, cfg.logging.progress, args.batch, args.samples)
            for label, env, tasks in sets
        }
    finally:
        backend.close()
    report = {"model": model, "backend": cfg.sampler.backend, **_overall(results), "datasets": results}
    print(json.dumps(report, sort_keys=True) if args.json else _table(report))
    return 0


def _overall(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Task-weighted means over the datasets."""
    n = sum(r["n"] for r in results.values())
    keys = [
        k
        for k in ("success", "em", "f1", "answered", "sampled_success", "pass_at_k")
        if all(k in r for r in results.values())
    ]
    return {"n": n, **{k: round(sum(r[k] * r["n"] for r in results.values()) / max(1, n), 4) for k in keys}}


def _table(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']} ({report['backend']} backend, greedy)"]
    lines.append(f"{'dataset':<28}{'n':>6}{'success':>9}{'EM':>8}{'F1':>8}{'answered':>10}{'turns':>7}")

    def line(name: str, r: dict[str, Any]) -> str:
        turns = f"{r['mean_turns']:>7.2f}" if "mean_turns" in r else ""
        row = f"{r['success']:>9.3f}{r['em']:>8.3f}{r['f1']:>8.3f}{r['answered']:>10.3f}"
        return f"{name:<28}{r['n']:>6}{row}{turns}"

    for label, r in report["datasets"].items():
        lines.append(line(label, r) + f"   ({r['seconds']:.1f} s)")
        for hop, h in r.get("per_hop", {}).items():
            lines.append(line(f"  {hop}-hop", h))
        if "samples" in r:
            k, p1, pk = r["samples"], r["sampled_success"], r["pass_at_k"]
            lines.append(f"  sampled (T=1, {k} per task): pass@1 {p1:.3f}, pass@{k} {pk:.3f}")
        if "retrieval_recall" in r:
            lines.append(
                f"  retrieval recall (qrels, {r['recall_tasks']} tasks): {r['retrieval_recall']:.3f}"
            )
    if len(report["datasets"]) > 1:
        lines.append(line("overall", report))
    return "\n".join(lines)
