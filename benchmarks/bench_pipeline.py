"""`treeopsd bench pipeline --json`: asynchronous vs synchronous trees/s, one sampler and one learner with one
CPU each, same components, same config; only `run.mode` (and so admission) differs.

With per-batch sampling time S and training time L, synchronous training takes S + L per batch and a
perfect pipeline max(S, L), so `async_over_sync` ≤ (S + L)/max(S, L) ≤ 2 — the limit reported beside it.
The first step of each run is warm-up and is not timed.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

BATCH = 8  # trees per fixed rollout batch


def _config(run_dir: Path, mode: str, quick: bool) -> Any:
    from configs.schema import load_config

    overrides = {
        "run.run_dir": str(run_dir),
        "run.mode": mode,
        "store.eta": 1 if mode == "async" else 0,
        "sampler.num_samplers": 1,
        "sampler.prompts_per_request": 2,
        "learner.batch_trees": BATCH,
        "learner.minibatches": 4,
        "learner.epochs": 16,  # balances training time with sampling time on the tiny model (see run())
        "algo.M": 4,
        "algo.N": 2,
        "env.max_turns": 3,
        "env.max_turn_tokens": 48,
        "resources.sampler.num_cpus": 1,
        "resources.learner.num_cpus": 1,
    }
    return load_config(overrides=[f"{k}={v}" for k, v in overrides.items()])


def _timed_run(cfg: Any, model_dir: str, steps: int) -> dict[str, float]:
    import ray

    from runtime.driver import Driver, start_topology, stop_topology
    from storage.metrics import MemorySink
    from system.roles import StoreRole

    topo = start_topology(cfg, model_dir)
    sink = MemorySink()
    try:
        driver = Driver(cfg, topo, sink)
        driver.run(1)  # warm-up: actor start, first weights, first batch
        consumed0 = ray.get(topo.store.call(StoreRole.stats))["trees"]["consumed"]
        t0 = time.perf_counter()
        driver.run(1 + steps)
        elapsed = time.perf_counter() - t0
        consumed = ray.get(topo.store.call(StoreRole.stats))["trees"]["consumed"] - consumed0
    finally:
        stop_topology(topo)
    step_s = [v for _, v in sink.series["learner/step_s"]][1:]
    return {
        "trees_per_s": consumed / elapsed,
        "elapsed_s": elapsed,
        "learner_step_s": sum(step_s) / len(step_s),
    }


def _tiny_model(root: Path) -> str:
    from actors.envs.synthetic_kb import SyntheticKBEnv, tokenizer_texts
    from actors.policy.tiny_model import save_tiny

    folder = root / "model"
    save_tiny(folder, tokenizer_texts(SyntheticKBEnv(), n_questions=300, n_oracle=30), seed=0)
    return str(folder)


def run(args: Any) -> dict[str, Any]:
    import ray

    from runtime.driver import init_ray

    quick = bool(getattr(args, "quick", False))
    steps = 3 if quick else 6
    with tempfile.TemporaryDirectory(prefix="treeopsd-bench-pipeline-") as tmp:
        root = Path(tmp)
        model_dir = _tiny_model(root)
        init_ray(_config(root / "probe", "async", quick))
        try:
            sync = _timed_run(_config(root / "sync", "sync", quick), model_dir, steps)
            asyn = _timed_run(_config(root / "async", "async", quick), model_dir, steps)
        finally:
            ray.shutdown()
    per_batch_sync = BATCH / sync["trees_per_s"]
    sample_s = max(per_batch_sync - sync["learner_step_s"], 1e-9)
    bound = (sample_s + sync["learner_step_s"]) / max(sample_s, sync["learner_step_s"])
    return {
        "steps_timed": steps,
        "sample_s_per_batch": round(sample_s, 3),
        "pipeline_bound": round(bound, 3),  # (S + L)/max(S, L) for the measured S and L
        "sync_trees_per_s": round(sync["trees_per_s"], 4),
        "async_trees_per_s": round(asyn["trees_per_s"], 4),
        "async_over_sync": round(asyn["trees_per_s"] / sync["trees_per_s"], 3),
        "limit": 2.0,
        "goal": 1.6,
        "learner_step_s": round(sync["learner_step_s"], 3),
    }
