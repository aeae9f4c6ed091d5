"""`treeopsd rollout`: sample initialize–expand rollout trees for P training prompts into a replay store.

    treeopsd rollout --config configs/default.yaml --prompts 64 --store runs/rollouts
    treeopsd rollout --prompts 8 --store /tmp/s sampler.backend=vllm algo.M=2 algo.N=1
    treeopsd rollout --prompts 32 --store /tmp/s --samplers 2 --json

Runs K in-process samplers (`TreeSampler`, threads; each its own backend, environment and seed stream) with
no Ray and no learner: each samples `--chunk` prompts at a time and commits them with one `put_raw`, so an
interrupted run keeps every finished chunk. The model is `model.path`, else the cached warm-started tiny
model. Tree ids are unique per run (the store's tree count seeds the worker incarnation), so repeated runs
append to the same store. Prints trees, leaves, tokens and seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

from launch.cli import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("--prompts", type=positive_int, required=True, help="training prompts to sample (P)")
    parser.add_argument("--store", default=None, help="replay store folder (default: the config's store)")
    parser.add_argument("--samplers", type=positive_int, default=1, help="in-process sampler workers (K)")
    parser.add_argument("--chunk", type=positive_int, default=None, help="prompts per commit (default 8)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")


def run(args: argparse.Namespace) -> int:
    from configs.schema import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"treeopsd rollout: {e}", file=sys.stderr)
        return 2
    from runtime.model_setup import ModelPathError, resolve_model
    from storage.replay_store import ReplayStore, StoreError

    store_dir = args.store or cfg.store_dir
    try:
        model = resolve_model(cfg, progress=cfg.logging.progress)
        store = ReplayStore(store_dir, create=True)
    except (ModelPathError, StoreError) as e:
        print(f"treeopsd rollout: {e}", file=sys.stderr)
        return 2
    with store:
        summary = sample_into(cfg, model, store, args.prompts, args.samplers, args.chunk or 8)
        summary["store_trees"] = store.stats()["trees"]["total"]
    summary.update(store=str(store_dir), model=model, backend=cfg.sampler.backend)
    print(json.dumps(summary, sort_keys=True) if args.json else _text(summary))
    return 0


def sample_into(cfg: Any, model: str, store: Any, prompts: int, samplers: int, chunk: int) -> dict[str, Any]:
    """Fills `store` with trees for `prompts` prompts from `samplers` workers; returns the summary."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    from actors.sampler_setup import sampler_seed
    from actors.tree_sampler import TreeSampler
    from runtime.builder import make_sampler
    from runtime.model_setup import build_policy

    incarnation = len(store.tree_ids())  # grows with every run: fresh tree ids and seeds each time
    workers: list[TreeSampler] = []
    quotas = [prompts // samplers + (i < prompts % samplers) for i in range(samplers)]
    totals = {"trees": 0, "leaves": 0, "turns": 0, "sampled_tokens": 0, "reward_sum": 0.0}
    lock = threading.Lock()
    bar = tqdm(total=prompts, desc="rollout", unit="prompt", disable=not cfg.logging.progress)

    def work(worker: TreeSampler, quota: int) -> None:
        while quota > 0:
            n = min(chunk, quota)
            trees = worker.sample(n)
            store.put_raw(trees)  # one durable commit per chunk
            quota -= n
            with lock:
                _add(totals, trees)
                bar.update(n)

    t0 = time.perf_counter()
    try:
        for i in range(samplers):
            backend = build_policy(cfg, model, seed=sampler_seed(cfg, i, incarnation))
            workers.append(make_sampler(cfg, model, i, incarnation, backend=backend))
        t0 = time.perf_counter()  # seconds = sampling and commits, not engine/env start-up
        if samplers == 1:
            work(workers[0], quotas[0])  # no thread: plain tracebacks
        else:
            with ThreadPoolExecutor(samplers) as pool:  # torch and vLLM release the GIL while sampling
                for f in [pool.submit(work, w, q) for w, q in zip(workers, quotas, strict=True)]:
                    f.result()
    finally:
        bar.close()
        for w in workers:
            w.close()
    seconds = time.perf_counter() - t0
    return {
        "prompts": prompts,
        "samplers": samplers,
        **{k: v for k, v in totals.items() if k != "reward_sum"},
        "mean_leaf_reward": round(totals["reward_sum"] / max(1, totals["leaves"]), 4),
        "seconds": round(seconds, 2),
        "tokens_per_s": round(totals["sampled_tokens"] / max(seconds, 1e-9), 1),
    }


def _add(totals: dict[str, Any], trees: list[Any]) -> None:
    for t in trees:
        totals["trees"] += 1
        totals["leaves"] += t.num_leaves
        totals["turns"] += len(t.nodes) - 1
        totals["sampled_tokens"] += sum(len(n.tokens) for n in t.nodes[1:])
        totals["reward_sum"] += float(t.leaf_rewards().sum())


def _text(s: dict[str, Any]) -> str:
    return (
        f"rollout: {s['trees']} trees from {s['prompts']} prompts ({s['leaves']} leaves, {s['turns']} turns, "
        f"{s['sampled_tokens']} sampled tokens) in {s['seconds']:.1f} s = {s['tokens_per_s']:.0f} tokens/s, "
        f"mean leaf reward {s['mean_leaf_reward']:.3f}\n"
        f"store {s['store']} now holds {s['store_trees']} trees ({s['backend']} backend, model {s['model']})"
    )
