"""`treeopsd soak`: train while killing a random role every K seconds, then audit the store and the batches.

    treeopsd soak --minutes 30 --every 30 --run-dir runs/soak [--config X.yaml] [--seed 0] [k=v ...]

Trains on the given config (default: the embedded default) for `--minutes` on local Ray, and every `--every`
seconds SIGKILLs one process of a random role — a sampler, the backup, the store, the learner (any rank) —
picked with `--seed` (faults/soak.py). The restart budgets are lifted for the soak (the kills are on
purpose). At the end the run stops as on Ctrl-C (the learner's step in flight ends, a final checkpoint),
and the report — printed as one JSON object and written to RUN_DIR/soak.json — gives, from the store's own
files and the driver's batch events: trees committed, lost, duplicated, half-visible; batches trained twice
or skipped; kills and restarts per role; the resident memory of every role's processes (the largest slope
after warm-up, MB/min). Exit 0 when nothing was lost, duplicated, half-visible, trained twice or skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROLES = ("sampler", "backup", "store", "learner")
UNLIMITED = 1_000_000  # restart budgets during a soak


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, required=True, help="how long to train")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (roles and victims)")
    parser.add_argument("--memory-every", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("--run-dir", default="runs/soak", help="a new run directory")
    parser.add_argument(
        "--results", default=None, help="also copy the report to DIR/soak.json (for make readme)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")


def soak_config(args: argparse.Namespace) -> Any:
    from configs.schema import load_config

    extra = [
        f"run.run_dir={args.run_dir}",
        f"run.time_limit_s={args.minutes * 60:g}",
        f"run.steps={UNLIMITED}",
        f"run.max_learner_restarts={UNLIMITED}",
        f"run.max_store_restarts={UNLIMITED}",
        f"run.max_backup_restarts={UNLIMITED}",
        f"sampler.max_restarts={UNLIMITED}",
        "logging.progress=false",
    ]
    return load_config(args.config, [*args.overrides, *extra])


def soak(cfg: Any, model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    """The run under kills; returns what the report is computed from."""
    import ray

    from faults.soak import Killer, MemoryWatch
    from runtime.driver import Driver, init_ray, start_topology, stop_topology
    from runtime.signals import GracefulStop, finish_step
    from storage.tracking import run_sink

    init_ray(cfg)
    sink = run_sink(cfg, Path(cfg.run.run_dir))
    killer, memory = Killer(args.every, ROLES, args.seed), MemoryWatch(args.memory_every)
    with GracefulStop() as stop:
        topo = start_topology(cfg, model_path)
        try:
            driver = Driver(cfg, topo, sink)
            driver.stop_requested = stop.requested
            memory.start()
            killer.start()
            summary = driver.run(cfg.run.steps)
            killer.stop()
            finish_step(driver)
            summary["checkpoint"] = driver.supervisor.save_final(driver)  # the last kill may be in recovery
            summary.update(steps=driver.step, sampler_restarts=sampler_restarts(topo))
            summary["learner_version"] = int(ray.get(topo.learner.progress.remote())["version"])
        finally:
            killer.stop()
            memory.stop()
            stop_topology(topo)
            sink.close()
    return {"summary": summary, "events": driver.supervisor.events, "kills": killer.kills, "memory": memory}


def sampler_restarts(topo: Any) -> int:
    """Ray's count (GCS) over the samplers now managed, or the manager's when Ray does not say; the manager
    sees only the restarts of samplers it had marked unhealthy (one killed between two calls is not)."""
    from runtime.supervision import gcs_restarts

    ids = [r.get() for r in topo.manager.foreach_actor("actor_id", timeout_seconds=30) if r.ok]
    counts = [gcs_restarts(i) for i in ids]
    seen = topo.manager.total_num_restarts()
    return seen if None in counts else max(seen, sum(c for c in counts if c is not None))


def report(cfg: Any, got: dict[str, Any], minutes: float) -> dict[str, Any]:
    from faults.soak import audit_store
    from runtime.restart_policy import batch_audit

    summary, steps = got["summary"], got["summary"]["steps"]
    store, batches = audit_store(cfg.store_dir), batch_audit(got["events"], steps)
    restarts = {**summary["restarts"], "sampler": summary["sampler_restarts"]}
    warmup_s = 120.0  # per process, from its first sample: model load, first steps, first checkpoint
    window_s = 300.0  # the shortest life past warm-up whose slope can tell a leak from a transient
    memory = got["memory"].report(warmup_s, window_s)
    slopes = [m["max_slope_mb_per_min"] for m in memory.values() if m["max_slope_mb_per_min"] is not None]
    bad = (store["trees_lost"], store["trees_duplicated"], store["trees_half_visible"])
    ok = bad == (0, 0, 0) and not batches["twice"] and not batches["skipped"] and store["batches"] == steps
    return {
        "ok": ok,
        "minutes": minutes,
        "steps": steps,
        "store": store,
        "batches_trained_twice": batches["twice"],
        "batches_skipped": batches["skipped"],
        "batches_trained_without_metrics": batches["unlogged"],
        "batches_handed_out_not_trained": store["batches"] - steps,
        "kills": dict(Counter(role for _, role, _ in got["kills"])),
        "kill_log": got["kills"],
        "restarts": restarts,
        "learner_step_retries": summary["learner_step_retries"],
        "memory_warmup_s": warmup_s,
        "memory_window_s": window_s,
        "memory": memory,
        "memory_series": got["memory"].series_mb(),
        "max_rss_slope_mb_per_min": max(slopes, default=None),
        "checkpoint": summary["checkpoint"],
    }


def run(args: argparse.Namespace) -> int:
    from configs.schema import ConfigError
    from launch.cmd_train import prepare_run_dir
    from runtime.model_setup import ModelPathError, resolve_model
    from storage.durable import write_atomic

    if os.environ.get("RAY_ADDRESS"):
        print(
            "treeopsd soak: runs on a local Ray instance only (it kills processes by pid); unset RAY_ADDRESS"
        )
        return 2
    try:
        cfg = soak_config(args)
        model_path = resolve_model(cfg, progress=False)
    except (ConfigError, ModelPathError) as e:
        print(f"treeopsd soak: {e}", file=sys.stderr)
        return 2
    prepare_run_dir(cfg, resume=False)
    out = {**report(cfg, soak(cfg, model_path, args), args.minutes), "every": args.every, "seed": args.seed}
    text = json.dumps(out, indent=2, default=str)
    write_atomic(Path(cfg.run.run_dir) / "soak.json", text.encode())
    if args.results:  # `make readme` renders docs/results.md's block from it (tools/fault_report.py)
        Path(args.results).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(args.results) / "soak.json", text.encode())
    print(text)
    return 0 if out["ok"] else 1
