"""Evaluation: a model's success on tasks through the sampler's own agent loop (what `treeopsd eval`, the
trainer's --eval, the warm-start and the experiment grid report).

    report = evaluate(cfg, model_path, tasks, env, samples=4)

Greedy: one episode per task (temperature 0). With `samples` = K > 0, also K sampled episodes per task at
temperature 1 (`sampled_success`: the mean reward over them, an estimate of pass@1; `pass_at_k`: the share
of tasks with at least one success). Episodes run `batch` at a time through one backend call per turn, with
the same tool parsing, limits and token-in/token-out bookkeeping as training rollouts. success = mean reward
(0/1 exact match here); EM/F1 use the official answer normalization and count 0 for episodes that never
answer; per hop count where the tasks have one.

With `workers` = W > 1 the episodes are split into W contiguous shards, each run by a thread of its own
with a backend of its own (torch releases the GIL in its kernels: W cores busy, each on model.threads
threads, which a busy machine slows less than W intra-op threads of one backend). Sampled episode i draws
with its own seed (mix_seed(run.seed + 1, i)), so its draws do not depend on W or on `batch`; a question's
K samples stay in one shard and one batch, where the HF backend prefills their shared context once.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any


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
    samples: int = 0,
    workers: int = 1,
) -> dict[str, Any]:
    """Greedy episodes on `tasks` (and `samples` sampled ones per task, module docstring); returns {n,
    success, em, f1, answered, mean_turns, finish, datasets, per_hop (synthetic KB), seconds} plus, with
    samples, {samples, sampled_success, pass_at_k, sampled: the same stats over the sampled episodes}.
    `backend`: a greedy backend to reuse (closed by the caller; its run is not split); None builds one per
    worker from cfg and closes it."""
    from runtime.model_setup import build_policy

    t0 = time.perf_counter()
    if backend is not None:
        rows = _episodes(cfg, model_path, backend, tasks, env, batch, progress, "greedy")
    else:
        greedy = lambda: build_policy(cfg, model_path, seed=cfg.run.seed, greedy=True)  # noqa: E731
        rows = _sharded(cfg, model_path, greedy, tasks, env, batch, progress, "greedy", workers)
    report = summarize(rows)
    report["task_rewards"] = {r["task_id"]: r["reward"] for r in rows}  # for paired comparisons
    if samples > 0:
        report.update(_sampled(cfg, model_path, tasks, env, batch, progress, samples, workers))
    return {**report, "seconds": round(time.perf_counter() - t0, 2)}


def _sampled(cfg, model_path, tasks, env, batch, progress, samples, workers) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """K episodes per task at temperature 1, each with its own seed."""
    from runtime.model_setup import build_policy

    at_t1 = cfg.model_copy(
        update={"sampler": cfg.sampler.model_copy(update={"temperature": 1.0, "top_p": 1.0, "top_k": 0})}
    )
    repeated = [t for t in tasks for _ in range(samples)]
    make = lambda: build_policy(at_t1, model_path, seed=cfg.run.seed + 1)  # noqa: E731
    rows = _sharded(
        at_t1, model_path, make, repeated, env, batch, progress, "sampled", workers, cfg.run.seed + 1
    )
    per_task = defaultdict(list)
    for task, row in zip(repeated, rows, strict=True):
        per_task[task.task_id].append(row["reward"])
    stats = summarize(rows)
    hit = sum(max(r) > 0 for r in per_task.values()) / max(len(per_task), 1)
    return {
        "samples": samples,
        "sampled_success": stats["success"],
        "pass_at_k": round(hit, 4),
        "sampled": stats,
        # each task's mean reward over its samples: paired comparisons with less sampling noise
        "sampled_task_rewards": {k: sum(v) / len(v) for k, v in per_task.items()},
    }


def shard_bounds(n: int, workers: int, batch: int) -> list[tuple[int, int]]:
    """[start, stop) of each worker's contiguous shard of n episodes: about n / workers each, cut at a
    multiple of `batch` where the shard holds more than one batch (so the batches are the ones one worker
    would run, the samples of a question kept together)."""
    workers = max(1, min(workers, n))
    size = -(-n // workers)
    if size > batch:
        size = -(-size // batch) * batch
    return [(a, min(a + size, n)) for a in range(0, n, size)] if n else []


def _sharded(
    cfg, model_path, make_backend: Callable[[], Any], tasks, env, batch, progress, label, workers, seed=None
) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    """`_episodes` over the shards of `shard_bounds`, one thread and one backend each; rows in task order.
    The backends are built first, one after another (loading a model is not thread-safe)."""
    shards = shard_bounds(len(tasks), workers, batch)
    backends: list[Any] = []
    try:
        for _ in shards:
            backends.append(make_backend())

        def run(k: int) -> list[dict[str, Any]]:
            start, stop = shards[k]
            part = tasks[start:stop]
            return _episodes(cfg, model_path, backends[k], part, env, batch, progress, label, start, seed)

        if len(shards) <= 1:
            return run(0) if shards else []
        with ThreadPoolExecutor(len(shards), thread_name_prefix=f"eval-{label}") as pool:
            return [row for part in pool.map(run, range(len(shards))) for row in part]
    finally:
        for backend in backends:
            backend.close()


def _episodes(
    cfg, model_path, backend, tasks, env, batch, progress, label, first=0, seed=None
) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    """One episode per task through the agent loop, `batch` at a time; a row of results per episode.
    Episode `first` + i is named by its index and, with `seed`, draws with mix_seed(seed, first + i)."""
    from tqdm.auto import tqdm

    from actors.agent_loop import Episode, run_episodes
    from actors.protocols import bind_protocol
    from actors.sampler_setup import loop_limits
    from experiments.retrieval_recall import episode_recall
    from runtime.model_setup import load_tokenizer
    from system.policy import mix_seed
    from system.tree_build import TreeBuilder

    tokenizer = getattr(backend, "tokenizer", None) or load_tokenizer(model_path)
    chat, agent_env = bind_protocol(cfg.env, tokenizer, env, evaluation=True)  # env.protocol, as in training
    recorder, limits, rows = _FinalSteps(agent_env), loop_limits(cfg), []
    with tqdm(
        total=len(tasks), desc=f"eval {label}", unit="task", disable=not progress, mininterval=1.0
    ) as bar:
        for start in range(0, len(tasks), max(1, batch)):
            part = [replace(t) for t in tasks[start : start + max(1, batch)]]
            episodes = []
            for i, task in enumerate(part):
                n = first + start + i
                prompt = chat.initial_context(agent_env.system_prompt(), agent_env.user_prompt(task))
                b = TreeBuilder(f"eval-{label}-{n}", prompt, prompt_id=task.task_id)
                own = None if seed is None else mix_seed(seed, n)
                episodes.append(Episode(task, b, 0, b.context_tokens(0), [], 0, key=b.tree_id, seed=own))
            run_episodes(episodes, backend, recorder, chat, limits)
            recalls = episode_recall(env, episodes)  # None without qrels
            rows += [
                _row(e, recorder.info.get(id(e.task), {}), r) for e, r in zip(episodes, recalls, strict=True)
            ]
            _evict(backend, episodes)
            bar.update(len(part))
    return rows


def _row(e: Any, info: dict[str, Any], recall: float | None = None) -> dict[str, Any]:
    return {
        "task_id": e.task.task_id,
        "recall": recall,
        "dataset": e.task.dataset,
        "hops": e.task.meta.get("hops"),
        "reward": float(e.reward or 0.0),
        "em": float(info.get("em", 0.0)),
        "f1": float(info.get("f1", 0.0)),
        "finish": str(e.finish),
        "turns": len(e.nodes),
        # Σ log-probs of the sampled turn tokens and their count: at temperature 1, −Σ/count estimates the
        # policy's per-token entropy along its own episodes
        "logp_sum": sum(float(e.builder.node(j).behavior_logprobs.sum()) for j in e.nodes),
        "tokens": sum(len(e.builder.node(j).behavior_logprobs) for j in e.nodes),
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
    out = {
        "n": n,
        "success": mean("reward"),
        "em": mean("em"),
        "f1": mean("f1"),
        "answered": round(answered, 4),
        "mean_turns": mean("turns"),
    }
    tokens = sum(r.get("tokens", 0) for r in rows)
    if tokens:
        out["token_nll"] = round(-sum(r.get("logp_sum", 0.0) for r in rows) / tokens, 4)
    recalls = [r["recall"] for r in rows if r.get("recall") is not None]
    if recalls:  # tasks with qrels: the fraction of their gold documents some search returned
        out["retrieval_recall"] = round(sum(recalls) / len(recalls), 4)
        out["recall_tasks"] = len(recalls)
    return out


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


def paired_difference(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, int]:
    """(mean of after − before, its standard error, n) over the tasks both evaluations share: the paired
    comparison of one model before and after training on the same questions, SE = sd(d) / √n (sample sd)."""
    shared = sorted(set(before) & set(after))
    d = [after[k] - before[k] for k in shared]
    n = len(d)
    if n < 2:
        return (d[0] if d else 0.0), float("nan"), n
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean, (var / n) ** 0.5, n
