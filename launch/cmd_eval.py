"""`treeopsd eval`: greedy success / EM / F1 of a model, per dataset (and per hop count on the synthetic KB).

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
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any


class EvalDataError(ValueError):
    """An evaluation data file that cannot be used; the message names the file."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: model.path / tiny)")
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("--data", action="append", default=None, help="a local dataset file (repeatable)")
    parser.add_argument("--limit", type=int, default=None, help="at most N tasks per dataset")
    parser.add_argument("--batch", type=int, default=32, help="episodes per backend call (default 32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")


# ---- evaluation (the trainer imports this) ---------------------------------------------------------------
class _FinalSteps:
    """Environment proxy keeping each episode's final StepResult.info (answer, em, f1) — the loop drops it."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.info: dict[int, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def step(self, task: Any, history: Any, action_text: str) -> Any:
        result = self.env.step(task, history, action_text)
        if result.done:
            self.info[id(task)] = result.info  # tasks are copied per episode, so id() is unique
        return result


def evaluate(
    cfg: Any,
    model_path: str,
    tasks: Sequence[Any],
    env: Any,
    backend: Any = None,
    progress: bool = False,
    batch: int = 32,
) -> dict[str, Any]:
    """Greedy single-trajectory episodes on `tasks`; returns {n, success, em, f1, answered, mean_turns,
    finish, datasets, per_hop (synthetic KB), seconds}. `backend`: a greedy backend to reuse (closed by the
    caller); None builds one from cfg and closes it."""
    from tqdm.auto import tqdm

    from actors.agent_loop import Episode, run_episodes
    from actors.chat import ChatFormat
    from actors.sampler_setup import loop_limits
    from launch.model_setup import build_policy, load_tokenizer
    from system.tree_build import TreeBuilder

    own = backend is None
    if own:
        backend = build_policy(cfg, model_path, seed=cfg.run.seed, greedy=True)
    t0, rows = time.perf_counter(), []
    try:
        chat = ChatFormat.from_tokenizer(getattr(backend, "tokenizer", None) or load_tokenizer(model_path))
        recorder, limits = _FinalSteps(env), loop_limits(cfg)
        with tqdm(total=len(tasks), desc="eval", unit="task", disable=not progress, mininterval=1.0) as bar:
            for start in range(0, len(tasks), max(1, batch)):
                part = [replace(t) for t in tasks[start : start + max(1, batch)]]
                episodes = []
                for i, task in enumerate(part):
                    prompt = chat.initial_context(env.system_prompt(), env.user_prompt(task))
                    b = TreeBuilder(f"eval-{start + i}", prompt, prompt_id=task.task_id)
                    episodes.append(Episode(task, b, 0, b.context_tokens(0), [], 0, key=b.tree_id))
                run_episodes(episodes, backend, recorder, chat, limits)
                rows += [_row(e, recorder.info.get(id(e.task), {})) for e in episodes]
                _evict(backend, episodes)
                bar.update(len(part))
    finally:
        if own:
            backend.close()
    return {**summarize(rows), "seconds": round(time.perf_counter() - t0, 2)}


def _row(e: Any, info: dict[str, Any]) -> dict[str, Any]:
    return {
        "dataset": e.task.dataset,
        "hops": e.task.meta.get("hops"),
        "reward": float(e.reward or 0.0),
        "em": float(info.get("em", 0.0)),
        "f1": float(info.get("f1", 0.0)),
        "finish": str(e.finish),
        "turns": len(e.nodes),
    }


def _evict(backend: Any, episodes: Sequence[Any]) -> None:
    """Frees the HF backend's per-episode KV caches (vLLM has no such caches)."""
    if hasattr(backend, "evict"):
        backend.evict(*(e.key for e in episodes))


def _stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)

    def mean(key: str) -> float:
        return round(sum(r[key] for r in rows) / n, 4) if n else 0.0

    answered = sum(r["finish"] == "answer" for r in rows) / n if n else 0.0
    return {
        "n": n,
        "success": mean("reward"),
        "em": mean("em"),
        "f1": mean("f1"),
        "answered": round(answered, 4),
        "mean_turns": mean("turns"),
    }


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Overall stats, finish reasons, per dataset, and per hop count where tasks have one."""
    by_set: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_hop: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_set[r["dataset"]].append(r)
        if r["hops"] is not None:
            by_hop[str(r["hops"])].append(r)
    out = {**_stats(rows), "finish": dict(Counter(r["finish"] for r in rows))}
    out["datasets"] = {name: _stats(group) for name, group in sorted(by_set.items())}
    if by_hop:
        out["per_hop"] = {hop: _stats(group) for hop, group in sorted(by_hop.items())}
    return out


# ---- which tasks ---------------------------------------------------------------------------------------
def take(tasks: Sequence[Any], limit: int | None) -> list[Any]:
    """At most `limit` tasks, round-robin over (dataset, hops) groups so a limit keeps every hop count."""
    if limit is None or limit >= len(tasks):
        return list(tasks)
    groups: dict[tuple[str, Any], list[Any]] = defaultdict(list)
    for t in tasks:
        groups[(t.dataset, t.meta.get("hops"))].append(t)
    lists = list(groups.values())
    mixed = [g[i] for i in range(max(map(len, lists))) for g in lists if i < len(g)]
    return mixed[: max(0, limit)]


def eval_sets(cfg: Any, data: Sequence[str]) -> list[tuple[str, Any, list[Any]]]:
    """(label, env, tasks) per dataset: the config's eval split, or one per `--data` file."""
    from actors.sampler_setup import build_env, load_split

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


# ---- the command ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from configs.schema import ConfigError, load_config
    from launch.model_setup import ModelPathError, build_policy, check_model_path, resolve_model

    try:
        cfg = load_config(args.config, args.overrides)
        model = check_model_path(args.model, "--model") if args.model else None
        sets = [(name, env, take(tasks, args.limit)) for name, env, tasks in eval_sets(cfg, args.data or [])]
    except (ConfigError, ModelPathError, EvalDataError) as e:
        print(f"treeopsd eval: {e}", file=sys.stderr)
        return 2
    model = model or resolve_model(cfg, progress=cfg.logging.progress)
    backend = build_policy(cfg, model, seed=cfg.run.seed, greedy=True)
    try:
        results = {
            label: evaluate(cfg, model, tasks, env, backend, cfg.logging.progress, args.batch)
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
    keys = ("success", "em", "f1", "answered")
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
    if len(report["datasets"]) > 1:
        lines.append(line("overall", report))
    return "\n".join(lines)
