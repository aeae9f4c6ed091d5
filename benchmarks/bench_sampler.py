"""Sampler throughput and branch prefix reuse: our full TreeSampler vs the same backend called directly.

    treeopsd bench sampler --json            # 16 prompts of the default task, M=4, N=2
    treeopsd bench sampler --json --quick    # 4 prompts
    TREEOPSD_BENCH_BACKEND=hf treeopsd bench sampler --json   # force a backend (default: vllm if importable)

1. Sampler: `TreeSampler.sample` (agent loop + environment + initialize–expand tree bookkeeping) on a
   recording backend that keeps every `sample` call's exact SampleRequests and results.
2. Raw: the same calls, in the same order and batching, straight to a fresh backend with the same seed
   (HF: a new HFBackend; vLLM: the same engine with its request counter rewound and its prefix cache
   reset, since starting a second engine costs ~50 s). Only `backend.sample` is timed; `replay_identical`
   is the fraction of requests that came back with the same token ids.
   `sampler_over_raw` = raw_s / sampler_s (tokens/s ratio, same tokens; goal >= 0.9). Both phases run
   `repeats` times from the same state and the best time counts (the machine is shared);
   `sampler_backend_s` / `sampler_overhead_s` split the best sampler run into backend time and ours.
3. Prefix reuse for branches: over the requests that start a branch (context = the anchor's shared prefix),
   `prefix_tokens_total` (what a no-cache engine prefills), `prefix_tokens_cached` (the backend's
   `cached_prefix_tokens`), `prefix_tokens_recomputed`, `recompute_saved_frac`. `hf_*` are the HF backend's
   own numbers on the same requests (its per-episode KV reuse; an HF replay when vLLM is the backend), and
   `prefix_all_branch_turns` covers every turn of every branch. vLLM caches whole KV blocks
   (`kv_block_size`, 128 tokens on CPU), so only the block-aligned part of a shared prefix is reused.

4. The asynchronous loop (benchmarks/sampler_loops.py, same engine, same run): `sampler_over_raw_64`
   (the full sampler at 64 episodes in flight over the bare engine on the same requests, goal >= 0.95) and
   `async_over_lockstep` (trees/s of the async loop over the lockstep loop on a long-tailed workload, goal
   >= 1.3). Items 1-3 run the lockstep loop (`sampler.loop=lockstep`): they replay `backend.sample` calls.

5. `hf_decode` (benchmarks/hf_decode.py): the HF backend's lock-step decode step at SmolLM2-135M's
   dimensions, with and without its in-place cache and grouped attention.

Model: a finished warm-start in runtime/model_setup.py's cache if there is one, else a tiny model built here
from the synthetic KB's tokenizer texts and given a short SFT on oracle trajectories (QUICK_SFT_STEPS):
a random-init model never emits a stop token or a tool call, so its episodes end after one turn and its
trees have no branches to measure.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import tempfile
import time
from pathlib import Path
from typing import Any

QUICK_SFT_STEPS = 150
BRANCH_KIND = "b"  # TreeSampler's cache keys: "<tree>/b<j>" for branch episodes, "<tree>/m<m>" for trunks


class RecordingBackend:
    """Forwards to a backend; keeps each `sample` call's (requests, results) and the time spent in it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.backend_s = inner, 0.0
        self.calls: list[tuple[list[Any], list[Any]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sample(self, requests: Any) -> Any:
        t0 = time.perf_counter()
        results = self.inner.sample(requests)
        self.backend_s += time.perf_counter() - t0
        self.calls.append((list(requests), results))
        return results


def _kinds(requests: list[Any]) -> list[str]:
    """Per request, in call order: "start" (a branch's first turn: its context is the anchor's shared
    prefix), "branch" (a later branch turn) or "trunk". TreeSampler keys a branch episode "<tree>/b<j>" and a
    trunk "<tree>/m<m>" (a backend cache key may add more "/" parts)."""
    seen: set[str] = set()
    out = []
    for req in requests:
        parts = (req.cache_key or "").split("/")
        episode = "/".join(parts[:2])
        if len(parts) < 2 or not parts[1].startswith(BRANCH_KIND):
            out.append("trunk")
        else:
            out.append("branch" if episode in seen else "start")
            seen.add(episode)
    return out


def _model(cfg: Any, tmp: str, env: Any) -> tuple[str, str]:
    """(model folder, how it was obtained): the cached warm-start, else a tiny model with a short SFT."""
    from runtime.model_setup import cached_tiny_model

    cached = cached_tiny_model(cfg)
    if cached is not None:
        return cached, "cached warm-start"
    from actors.envs.synthetic_kb import tokenizer_texts
    from actors.policy.tiny_model import build_tiny_model, build_tokenizer, save_pretrained
    from actors.policy.warmstart import oracle_examples, sft_train

    tokenizer = build_tokenizer(tokenizer_texts(env))
    model = build_tiny_model(tokenizer, seed=0)
    examples = oracle_examples(tokenizer, env, env.tasks("train", n=600, hops=(2, 4)))
    sft_train(model, examples, QUICK_SFT_STEPS, pad_id=tokenizer.pad_token_id, progress=False)
    save_pretrained(Path(tmp) / "tiny", model, tokenizer)
    return str(Path(tmp) / "tiny"), f"tiny model + {QUICK_SFT_STEPS}-step SFT"


def _prefix(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    total = sum(len(req.context) for req, _ in pairs)
    cached = sum(int(res.cached_prefix_tokens) for _, res in pairs)
    return {
        "requests": len(pairs),
        "prefix_tokens_total": total,
        "prefix_tokens_cached": cached,
        "prefix_tokens_recomputed": total - cached,
        "recompute_saved_frac": round(cached / total, 4) if total else 0.0,
    }


def _warm_up(backend: Any, eos: int) -> None:
    """One small call so first-call costs (lazy init, kernel selection) fall outside both timings."""
    from system.policy import SampleRequest

    backend.sample([SampleRequest(list(range(3, 40)), 8, (eos,)) for _ in range(4)])


def _rewind_vllm(backend: Any, n_requests: int) -> None:
    """Makes the one engine behave like a fresh backend with the same seed: request counter back to where
    the sampler phase began (the per-request seeds derive from it), prefix cache emptied."""
    backend._n_requests = n_requests
    if not backend.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")


def _replay(calls: list[tuple[Any, Any]], backend: Any) -> tuple[float, int, int]:
    """(seconds inside backend.sample, requests, requests with identical token ids) over the same calls."""
    seconds, same, n = 0.0, 0, 0
    for requests, results in calls:
        t0 = time.perf_counter()
        again = backend.sample(requests)
        seconds += time.perf_counter() - t0
        n += len(requests)
        same += sum(a.token_ids == b.token_ids for a, b in zip(again, results, strict=True))
    return seconds, n, same


def _hf_prefix(cfg: Any, model: str, calls: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """HF's cached_prefix_tokens on the recorded requests, prefill only (max_new_tokens=1): exact for branch
    starts, whose anchor context is a prefix of the trunk context the HF cache already holds."""
    from dataclasses import replace

    from runtime.model_setup import build_policy

    hf = build_policy(_with(cfg, "sampler.backend=hf"), model, seed=cfg.run.seed)
    try:
        return [(r, hf.sample([replace(r, max_new_tokens=1)])[0]) for reqs, _ in calls for r in reqs]
    finally:
        hf.close()


def _with(cfg: Any, *overrides: str) -> Any:
    from configs.schema import parse_config, to_dict

    return parse_config(to_dict(cfg), list(overrides))


def _backend_name() -> str:
    forced = os.environ.get("TREEOPSD_BENCH_BACKEND")
    if forced in ("hf", "vllm"):
        return forced
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from actors.sampler_setup import build_env
    from benchmarks import hf_decode, sampler_loops
    from configs.schema import load_config
    from runtime.model_setup import build_policy

    quick = bool(getattr(args, "quick", False))
    prompts, chunk, repeats = (4, 4, 2) if quick else (16, 8, 2)
    # The per-call figures replay `backend.sample` calls: the lockstep loop makes them (sampler_loops.py
    # has the asynchronous loop's figures).
    cfg = load_config(None, [f"sampler.backend={_backend_name()}", "logging.progress=false"])
    env = build_env(cfg)
    with tempfile.TemporaryDirectory(prefix="treeopsd-bench-") as tmp:
        t0 = time.perf_counter()
        model, source = _model(cfg, tmp, env)
        out: dict[str, Any] = {"model": source, "model_build_s": round(time.perf_counter() - t0, 1)}
        t0 = time.perf_counter()
        backend = build_policy(cfg, model, seed=cfg.run.seed)  # one engine for every phase
        out["engine_start_s"] = round(time.perf_counter() - t0, 1)
        try:
            part, backend = _measure(
                _with(cfg, "sampler.loop=lockstep"), model, prompts, chunk, repeats, backend
            )
            out.update(part)
            # best of 10 (quick: 2): single repeats of either phase vary by ±20% on this shared machine
            out.update(sampler_loops.over_raw(cfg, model, backend, 4 if quick else 16, 2 if quick else 10))
            out.update(sampler_loops.async_over_lockstep(cfg, model, backend, env, 8 if quick else 16))
        finally:
            backend.close()
    out["hf_decode"] = hf_decode.measure(quick)  # the HF backend's decode step, before and after
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return {"backend": cfg.sampler.backend, "prompts": prompts, "M": cfg.algo.M, "N": cfg.algo.N, **out}


def _fresh(cfg: Any, model: str, rec: RecordingBackend, eos: int, n0: int) -> None:
    """Puts `rec` in front of a backend in the state the sampler phase started from."""
    from runtime.model_setup import build_policy

    if cfg.sampler.backend == "vllm":
        _rewind_vllm(rec.inner, n0)
        return
    rec.inner.close()
    rec.inner = build_policy(cfg, model, seed=cfg.run.seed)  # same seed: the same draws
    _warm_up(rec.inner, eos)


def _measure(
    cfg: Any, model: str, prompts: int, chunk: int, repeats: int, backend: Any
) -> tuple[dict[str, Any], Any]:
    """Sampler phase and raw replay, `repeats` times each from the same state (best time kept: the
    machine is shared), then prefix statistics; see the module docstring. Returns the backend too (HF: a
    fresh one per phase)."""
    from runtime.builder import make_sampler

    rec = RecordingBackend(backend)
    worker = make_sampler(cfg, model, backend=rec)
    eos = worker.chat.stop_token_ids[0]
    _warm_up(rec.inner, eos)
    n0, rng_state = getattr(rec.inner, "_n_requests", 0), worker.rng.bit_generator.state
    sampler_s: list[tuple[float, float]] = []
    raw_s: list[float] = []
    runs: list[tuple[list[Any], list[Any]]] = []  # (trees, calls) per repeat; all repeats are equal
    for _ in range(repeats):
        _fresh(cfg, model, rec, eos, n0)
        worker.rng.bit_generator.state, worker.counter, rec.calls = rng_state, 0, []
        gc.collect()  # neither timed phase pays for the other's garbage
        t1, rec.backend_s = time.perf_counter(), 0.0
        trees = [t for i in range(0, prompts, chunk) for t in worker.sample(min(chunk, prompts - i))]
        sampler_s.append((time.perf_counter() - t1, rec.backend_s))
        runs.append((trees, rec.calls))
        _fresh(cfg, model, rec, eos, n0)
        gc.collect()
        seconds, n_req, same = _replay(runs[0][1], rec.inner)
        raw_s.append(seconds)
    out: dict[str, Any] = {"kv_block_size": _block_size(rec.inner), "repeats": repeats}
    best, inside = min(sampler_s)
    trees, calls = runs[0]
    out.update(_throughput(trees, calls, best, min(raw_s), n_req, same))
    out["sampler_backend_s"] = round(inside, 3)  # of the best sampler run: time inside backend.sample
    out["sampler_overhead_s"] = round(best - inside, 3)  # agent loop, env, tree building
    return {**out, **_prefix_report(cfg, model, calls)}, rec.inner


def _throughput(
    trees: list[Any], calls: list[Any], sampler_s: float, raw_s: float, n: int, same: int
) -> dict[str, Any]:
    tokens = sum(len(r.token_ids) for _, results in calls for r in results)
    return {
        "trees": len(trees),
        "leaves": sum(t.num_leaves for t in trees),
        "calls": len(calls),
        "requests": n,
        "sampled_tokens": tokens,
        "sampler_s": round(sampler_s, 3),
        "sampler_tokens_per_s": round(tokens / sampler_s, 1),
        "raw_s": round(raw_s, 3),
        "raw_tokens_per_s": round(tokens / raw_s, 1),
        "sampler_over_raw": round(raw_s / sampler_s, 3),
        "replay_identical": round(same / max(1, n), 4),
    }


def _prefix_report(cfg: Any, model: str, calls: list[tuple[Any, Any]]) -> dict[str, Any]:
    pairs = [(q, r) for reqs, res in calls for q, r in zip(reqs, res, strict=True)]
    hf_pairs = pairs if cfg.sampler.backend == "hf" else _hf_prefix(cfg, model, calls)
    kinds = _kinds([q for q, _ in pairs])
    starts = _prefix([p for p, k in zip(pairs, kinds, strict=True) if k == "start"])
    hf_starts = _prefix([p for p, k in zip(hf_pairs, kinds, strict=True) if k == "start"])
    return {
        "branch_start_requests": starts.pop("requests"),
        **starts,
        **{f"hf_{k}": v for k, v in hf_starts.items() if k != "requests"},
        "prefix_all_branch_turns": _prefix([p for p, k in zip(pairs, kinds, strict=True) if k != "trunk"]),
        "prefix_all_requests": _prefix(pairs),
    }


def _block_size(backend: Any) -> int | None:
    block = getattr(backend, "block_size", None)  # vLLM's KV block (HF: none)
    return int(block) if block is not None else None
