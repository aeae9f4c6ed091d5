"""`treeopsd soak`: train while killing a random role every K seconds, then audit the store and the batches.

    treeopsd soak --minutes 30 --every 30 --run-dir runs/soak [--config X.yaml] [--seed 0] [k=v ...]

Runs `treeopsd train` on the given config (default: the embedded default) as a child process on local Ray,
with the restart budgets lifted (the kills are on purpose), and from the first batch the store hands out, for
`--minutes`, every `--every` seconds SIGKILLs one process of a random role — a sampler, the backup, the
store, the learner (any rank) — picked with `--seed` (faults/campaign.py:EverySeconds), while sampling the
resident memory of the child and every role process under it. Then the run stops as on Ctrl-C (SIGTERM: the
learner's step in flight ends, a final checkpoint) and is audited from its own files like `treeopsd drill`
(faults/audit.py). The report — printed as one JSON object and written to RUN_DIR/soak.json — gives trees
committed, lost, duplicated, half-visible; batches trained twice or skipped (the learner's lineage in
tensorboard against the store's live batches); kills and restarts per role; the resident memory of every
role's processes (the largest slope after warm-up, MB/min). Exit 0 when every check holds.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

UNLIMITED = 1_000_000  # restart budgets and steps during a soak: it ends on its clock
STARTUP_S = 1800.0  # past the minutes: startup to the first batch, then the stop (step in flight, checkpoint)
MEMORY_WARMUP_S = 120.0  # per process, from its first sample: model load, first steps, first checkpoint
MEMORY_WINDOW_S = 300.0  # the shortest life past warm-up whose slope can tell a leak from a transient


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


def soak_overrides(args: argparse.Namespace) -> list[str]:
    """The child's overrides: the user's, then the lifted budgets (a soak's kills are on purpose)."""
    extra = [
        f"run.max_learner_restarts={UNLIMITED}",
        f"run.max_store_restarts={UNLIMITED}",
        f"run.max_backup_restarts={UNLIMITED}",
        f"sampler.max_restarts={UNLIMITED}",
    ]
    return [*args.overrides, *extra]


def memory_figures(memory: Any) -> dict[str, Any]:
    """The report's memory keys from the campaign's MemoryWatch (faults/processes.py)."""
    per_role = memory.report(MEMORY_WARMUP_S, MEMORY_WINDOW_S)
    slopes = [m["max_slope_mb_per_min"] for m in per_role.values() if m["max_slope_mb_per_min"] is not None]
    return {
        "memory_warmup_s": MEMORY_WARMUP_S,
        "memory_window_s": MEMORY_WINDOW_S,
        "memory": per_role,
        "memory_series": memory.series_mb(),
        "max_rss_slope_mb_per_min": max(slopes, default=None),
    }


def run(args: argparse.Namespace) -> int:
    from faults.audit import audit_run
    from faults.campaign import EverySeconds, refused, run_campaign, train_command, write_report
    from faults.processes import ROLES

    overrides = soak_overrides(args)
    problem = refused("soak", args.run_dir, args.config, [*overrides, f"run.steps={UNLIMITED}"])
    if not problem and not (args.minutes > 0 and args.every > 0 and args.memory_every > 0):
        problem = "treeopsd soak: --minutes, --every and --memory-every must be above 0"
    if problem:
        print(problem, file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    schedule = EverySeconds(args.every, args.minutes, ROLES, args.seed)
    timeout_s = args.minutes * 60 + STARTUP_S
    child = train_command(run_dir, UNLIMITED, args.config, overrides)
    got = run_campaign(child, run_dir, schedule, timeout_s, memory_every_s=args.memory_every, name="soak")
    out = audit_run(run_dir, None, got.returncode, kills=got.kills)
    out |= {"minutes": args.minutes, "every": args.every, "seed": args.seed, "wall_s": got.wall_s}
    out |= {"kills": dict(Counter(role for _, role, _ in got.kills)), "kill_log": got.kills}
    out |= memory_figures(got.memory)
    print(write_report(out, "soak.json", run_dir, args.results))
    return 0 if out["ok"] else 1
