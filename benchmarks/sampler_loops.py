"""`bench sampler`'s figures for the asynchronous loop (benchmarks/bench_sampler.py runs them in the same
run, on the same engine):

1. `sampler_over_raw_64`: tokens/s of the full sampler (`sampler.loop=async`, 64 episodes in flight: agent
   loop, tools, trees) over the bare engine serving the same requests. Every turn the sampler asked for is
   recorded (`TurnTap`); the replay sends the same (prompt ids, sampling params) straight to the engine
   (vLLM: `AsyncLLM.generate` on its loop, no agent loop, no tree code), with the same dependencies the
   sampler had and no others: an episode's turns one after another (a turn's prompt holds the previous
   turn's output), a tree's branches after its trajectories, at most 64 episodes at once. Both phases start
   from an empty prefix cache; the best of `repeats` counts (each repeat runs both, one after the other).
   The default task's tools are in-memory lookups, so `sampler.tool_calls=auto` runs them on the event
   loop (`sampler_64_tool_calls`; docs/design.md §13); the search and observation caches start empty in
   every repeat, as in a sampler's first round. HF: the recorded batches, replayed on a fresh
   backend with the same seed.
2. `async_over_lockstep`: trees/s of `sampler.loop=async` over `sampler.loop=lockstep`, same tasks, same
   seeds, on a long-tailed workload: tasks of 1 to 4 hops (episodes of 2 to 5 turns and more; branches
   start at any turn), and about 1 turn in `TAIL_EVERY` is `TAIL_FACTOR`× longer (a long reasoning turn;
   chosen by a hash of the episode and its turn seed, so both loops stretch the same turns): when the
   engine returns a long turn after t seconds, it is held back (TAIL_FACTOR − 1)·t more. Per turn in the
   async loop (that episode waits, the others go on); per round in the lockstep loop (its one `sample`
   call per round ends with its slowest turn, as a real batch would). The sleep holds no engine capacity,
   where a real long decode holds one sequence slot of many. `async_over_lockstep_fixed`: the same with a
   fixed extra delay instead (TAIL_BASE_S per turn, TAIL_FACTOR× that for the long ones), for reference.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any

TAIL_BASE_S, TAIL_FACTOR, TAIL_EVERY = 0.05, 8, 10
INFLIGHT = 64
Delay = Callable[[Any, float], float]  # (request, the engine's seconds for it) -> extra seconds


class TurnTap:
    """Forwards to a backend; records every turn (request, result) and, with `delay`, stretches turns."""

    def __init__(self, inner: Any, delay: Delay | None = None) -> None:
        self.inner, self.delay = inner, delay
        self.turns: list[tuple[Any, Any]] = []
        self.calls: list[tuple[list[Any], list[Any]]] = []  # per `sample` call (the lockstep loop, HF)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sample(self, requests: Any) -> Any:
        t0 = time.perf_counter()
        results = self.inner.sample(requests)
        elapsed = time.perf_counter() - t0
        self.calls.append((list(requests), results))
        self.turns.extend(zip(requests, results, strict=True))
        if self.delay is not None and requests:
            time.sleep(max(self.delay(r, elapsed) for r in requests))  # a batch ends with its slowest turn
        return results

    def close(self) -> None:
        """The bench closes the inner backend itself, once, after every phase."""


class AsyncTurnTap(TurnTap):
    """TurnTap for a backend that serves turns itself (vLLM)."""

    async def generate_turn(self, request: Any) -> Any:
        t0 = time.perf_counter()
        result = await self.inner.generate_turn(request)
        self.turns.append((request, result))
        if self.delay is not None:
            await asyncio.sleep(self.delay(request, time.perf_counter() - t0))
        return result


def tap(inner: Any, delay: Delay | None = None) -> TurnTap:
    serves_turns = callable(getattr(inner, "generate_turn", None))
    return (AsyncTurnTap if serves_turns else TurnTap)(inner, delay)


def is_long(request: Any) -> bool:
    """About 1 turn in TAIL_EVERY, by a hash of its episode and turn seed (the same in both loops)."""
    return zlib.crc32(f"{request.cache_key}|{request.seed}".encode()) % TAIL_EVERY == 0


def stretch_delay(request: Any, elapsed: float) -> float:
    """A long turn takes TAIL_FACTOR× the time the engine took for it; the others as long as it took."""
    return (TAIL_FACTOR - 1) * elapsed if is_long(request) else 0.0


def fixed_delay(request: Any, elapsed: float) -> float:
    """Every turn TAIL_BASE_S more than the engine took, a long one TAIL_FACTOR× TAIL_BASE_S more."""
    return TAIL_BASE_S * (TAIL_FACTOR if is_long(request) else 1)


def _with(cfg: Any, *overrides: str) -> Any:
    from configs.schema import parse_config, to_dict

    return parse_config(to_dict(cfg), list(overrides))


def _worker(cfg: Any, model: str, backend: Any, loop: str) -> Any:
    from runtime.builder import make_sampler

    cfg = _with(cfg, f"sampler.loop={loop}", f"sampler.max_inflight_episodes={INFLIGHT}")
    return make_sampler(cfg, model, backend=backend)


def _clean(backend: Any) -> None:
    """Each phase starts from an empty prefix cache (vLLM) and without the last phase's garbage."""
    reset = getattr(backend, "reset_prefix_cache", None)
    if reset is not None and not reset():
        raise RuntimeError("vLLM refused to reset its prefix cache")
    gc.collect()


def _cold_tools(worker: Any) -> None:
    """Every repeat samples the same round: without this, the search and observation caches would hold
    all of its answers after the first (a real run's later rounds reuse only the repeated queries)."""
    for part in (getattr(worker.env, "index", None), worker.chat):
        clear = getattr(part, "clear_cache", None)
        if clear is not None:
            clear()


# ---- sampler_over_raw at 64 in flight ----------------------------------------------------------------------
def _chains(turns: list[tuple[Any, Any]]) -> dict[str, tuple[list[list[Any]], list[list[Any]]]]:
    """Per tree: its trajectories' and its branches' turn chains (each in order), from the recorded turns.
    TreeSampler's episode keys: "<tree>/m<m>" (trajectories), "<tree>/b<j>" (branches)."""
    by_key: dict[str, list[Any]] = {}
    for req, res in turns:
        by_key.setdefault(req.cache_key, []).append((req, res))
    trees: dict[str, tuple[list[list[Any]], list[list[Any]]]] = {}
    for key, chain in by_key.items():
        tree, kind = key.split("/")[:2]
        trees.setdefault(tree, ([], []))[1 if kind.startswith("b") else 0].append(chain)
    return trees


async def _replay_vllm(backend: Any, turns: list[tuple[Any, Any]]) -> tuple[float, int]:
    """(seconds, requests with the same token ids) of the bare engine on the recorded turns; see the module
    docstring. Prompts and sampling params are built before the clock starts."""
    engine, tag = backend._engine(), f"raw-{uuid.uuid4().hex[:6]}"

    def steps(chain: list[tuple[Any, Any]]) -> list[tuple[Any, Any, Any]]:
        return [
            (backend._prompt_cls(prompt_token_ids=list(q.context)), backend._sampling_params(q), r)
            for q, r in chain
        ]

    plan = {
        tree: [*map(steps, trunks), None, *map(steps, branches)]
        for tree, (trunks, branches) in _chains(turns).items()
    }
    slots, same = asyncio.Semaphore(INFLIGHT), [0]

    async def chain(steps: list[Any], cid: str) -> None:
        async with slots:
            for i, (prompt, params, recorded) in enumerate(steps):
                out = await engine.generate(prompt, params, f"{tag}-{cid}-{i}")
                same[0] += [int(t) for t in out.outputs[0].token_ids] == list(recorded.token_ids)

    async def tree(name: str, chains: list[Any]) -> None:
        cut = chains.index(None)  # trajectories before, branches after
        await asyncio.gather(*(chain(c, f"{name}m{i}") for i, c in enumerate(chains[:cut])))
        await asyncio.gather(*(chain(c, f"{name}b{i}") for i, c in enumerate(chains[cut + 1 :])))

    t0 = time.perf_counter()
    await asyncio.gather(*(tree(name, chains) for name, chains in plan.items()))
    return time.perf_counter() - t0, same[0]


def _replay_batches(cfg: Any, model: str, calls: list[Any]) -> tuple[float, int]:
    """HF: the recorded `sample` batches on a fresh backend with the same seed."""
    from runtime.model_setup import build_policy

    hf = build_policy(cfg, model, seed=cfg.run.seed)
    try:
        seconds, same = 0.0, 0
        for requests, results in calls:
            t0 = time.perf_counter()
            again = hf.sample(requests)
            seconds += time.perf_counter() - t0
            same += sum(a.token_ids == b.token_ids for a, b in zip(again, results, strict=True))
        return seconds, same
    finally:
        hf.close()


def over_raw(cfg: Any, model: str, backend: Any, prompts: int, repeats: int) -> dict[str, Any]:
    """`sampler_over_raw_64`; see the module docstring."""
    rec = tap(backend)
    worker = _worker(cfg, model, rec, "async")
    rng_state, runs, sampler_s, raw_runs_s = worker.rng.bit_generator.state, [], [], []
    for _ in range(repeats):
        worker.rng.bit_generator.state, worker.counter, rec.turns, rec.calls = rng_state, 0, [], []
        _clean(backend)
        _cold_tools(worker)
        t0 = time.perf_counter()
        trees = worker.sample(prompts)
        sampler_s.append(time.perf_counter() - t0)
        runs.append((trees, rec.turns, rec.calls))
        _clean(backend)
        if isinstance(rec, AsyncTurnTap):
            raw_s, same = backend.run_async(_replay_vllm(backend, rec.turns))
        else:
            raw_s, same = _replay_batches(cfg, model, rec.calls)
        raw_runs_s.append(raw_s)
    best_s, best_r = min(sampler_s), min(raw_runs_s)
    trees, turns, _ = runs[0]
    tokens = sum(len(r.token_ids) for _, r in turns)
    st, peak = worker.stats, worker.stats.get("sampler/inflight_peak", 0.0)
    n_turns = max(1.0, st.get("sampler/turns", 0.0))  # over every repeat, as are gen_s and tool_s
    worker.close()
    return {
        "sampler_64_tool_calls": "inline" if worker.inline_tools else "threads",  # sampler.tool_calls=auto
        "sampler_64_repeats": repeats,
        "sampler_64_mean_inflight": round(st.get("sampler/inflight_episodes", 0.0), 1),  # the last repeat
        "sampler_64_gen_ms_per_turn": round(1000 * st.get("sampler/gen_s", 0.0) / n_turns, 1),
        "sampler_64_tool_ms_per_turn": round(1000 * st.get("sampler/tool_s", 0.0) / n_turns, 1),
        "inflight_64_trees": len(trees),
        "inflight_64_requests": len(turns),
        "inflight_64_tokens": tokens,
        "inflight_64_peak_episodes": int(peak),
        "sampler_64_s": round(best_s, 3),
        "sampler_64_runs_s": [round(x, 3) for x in sampler_s],  # each repeat, in order
        "raw_64_runs_s": [round(x, 3) for x in raw_runs_s],
        "sampler_64_tokens_per_s": round(tokens / best_s, 1),
        "raw_64_s": round(best_r, 3),
        "raw_64_tokens_per_s": round(tokens / best_r, 1),
        "sampler_over_raw_64": round(best_r / best_s, 3),
        "raw_64_replay_identical": round(same / max(1, len(turns)), 4),
    }


# ---- async_over_lockstep -----------------------------------------------------------------------------------
def long_tail_tasks(env: Any, n: int) -> list[Any]:
    """n training tasks, hop counts 1 to 4 in turn (deterministic: the training split's own seed)."""
    per_hop = [env.tasks("train", n=-(-n // 4), hops=(h, h)) for h in (1, 2, 3, 4)]
    return [per_hop[i % 4][i // 4] for i in range(n)]


def async_over_lockstep(cfg: Any, model: str, backend: Any, env: Any, prompts: int) -> dict[str, Any]:
    """`async_over_lockstep` (long turns stretched TAIL_FACTOR×, `stretch_delay`) and
    `async_over_lockstep_fixed` (a fixed extra delay per turn, `fixed_delay`); see the module docstring."""
    out: dict[str, Any] = {"tail_prompts": prompts, "tail_base_s": TAIL_BASE_S, "tail_factor": TAIL_FACTOR}
    out["tail_every"] = TAIL_EVERY
    for suffix, delay in (("", stretch_delay), ("_fixed", fixed_delay)):
        out.update({f"{k}{suffix}": v for k, v in _loops(cfg, model, backend, env, prompts, delay).items()})
    return out


def _loops(cfg: Any, model: str, backend: Any, env: Any, prompts: int, delay: Delay) -> dict[str, Any]:
    """Lockstep first, async second, once each, same tasks and seeds (the machine is shared: the seconds
    and the load average are reported)."""
    import numpy as np

    tasks = long_tail_tasks(env, prompts)
    ids = [f"tail-{i:03d}" for i in range(prompts)]
    out: dict[str, Any] = {}
    shapes = []
    for loop in ("lockstep", "async"):
        rec = tap(backend, delay)
        worker = _worker(cfg, model, rec, loop)
        _clean(backend)
        t0 = time.perf_counter()
        trees = worker.sample_trees(tasks, np.random.default_rng(cfg.run.seed), ids)
        seconds = time.perf_counter() - t0
        worker.close()
        out[f"{loop}_s"] = round(seconds, 3)
        out[f"{loop}_trees_per_s"] = round(len(trees) / seconds, 3)
        out[f"{loop}_turns"] = len(rec.turns)
        out[f"{loop}_long_turns"] = sum(is_long(q) for q, _ in rec.turns)
        shapes.append([[len(n.tokens) for n in t.nodes] for t in trees])
    out["async_over_lockstep"] = round(out["async_trees_per_s"] / out["lockstep_trees_per_s"], 3)
    out["tail_same_tree_shapes"] = shapes[0] == shapes[1]  # same seeds; vLLM's batched floats may differ
    return out
