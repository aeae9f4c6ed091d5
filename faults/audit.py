"""What a training run's own files say after a fault campaign (faults/campaign.py): the learner's lineage of
trained batches (tensorboard), the store's live batches (its consumed log), the store's trees and quarantine,
`store verify`, the run's summary.json — and the verdict over them. Read-only: nothing is moved or repaired.

    lineage([(1, 0.0), (2, 1.0), (2, 1.0), (3, 2.0)])      # {1: 0, 2: 1, 3: 2}: a re-logged step replaces
    audit_store(run_dir / "store")                          # trees committed, lost, duplicated, half-visible
    audit_run(run_dir, steps=None, returncode=0)            # every check and figure both reports share
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from storage.store_files import StoreError


def lineage(events: Sequence[tuple[int, float]]) -> dict[int, int]:
    """{step: batch index} of the model the run ended with, from (step, learner/batch_index) in the order
    logged. A learner restarted from the checkpoint of step w logs steps w+1, ... again: a step logged again
    undoes it and every later step (the rewound model no longer holds them)."""
    held: dict[int, int] = {}
    for step, value in events:
        for s in [s for s in held if s >= step]:
            del held[s]
        held[int(step)] = int(value)
    return held


def read_batch_index_events(tb_dir: Path) -> list[tuple[int, float]]:
    """(step, learner/batch_index) in the order the driver logged them, with nothing purged."""
    from storage.metrics import read_scalars

    if not tb_dir.is_dir():  # the run ended before its first metrics
        return []
    return read_scalars(tb_dir, purge=False).get("learner/batch_index", [])


def live_batches(store_dir: Path) -> list[list[str]]:
    """The store's live batches (tree ids), replayed from its consumed log (read-only; [] before one)."""
    from storage.store_files import read_log, replay_log

    path = store_dir / "consumed.log"
    records, _, _ = read_log(path)
    return replay_log(records, path)


def batches_handed_out(store_dir: Path) -> int:
    """How many live batches the store has handed out now, read while the run writes: 0 when its log is not
    there yet or a record is being appended right now (the next read sees it)."""
    try:
        return len(live_batches(store_dir))
    except (OSError, StoreError):
        return 0


def audit_store(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What the store's own files say after a run (read-only open; moves nothing): trees committed, lost
    (a trained tree it no longer holds, or one in no state), duplicated (in two batches, or a raw commit
    refused as a repeat), half-visible (a committed segment that does not decode); and what the restarts
    left in quarantine/: commits killed before their rename and torn log tails (never visible)."""
    from storage.replay_store import ReplayStore
    from storage.store_files import REASON_SUFFIX

    with ReplayStore(directory, create=False, readonly=True) as store:
        stats, report = store.stats(), store.recovery_report
        batches = [store.batch_tree_ids(k) for k in range(store.watermark())]
        held = set(store.tree_ids())
    trained = [t for ids in batches for t in ids]
    trees = stats["trees"]
    in_no_state = trees["total"] - trees["raw"] - trees["credited"] - trees["consumed"]
    reasons = []
    for path in sorted((Path(directory) / "quarantine").glob(f"*{REASON_SUFFIX}")):
        reasons.append((path.name, json.loads(path.read_text())["reason"]))
    repeats = [n for n, r in reasons if "already committed" in r]
    interrupted = [n for n, r in reasons if n.startswith("tmp-") or "torn" in r]
    corrupt = [n for n, r in reasons if n not in repeats and n not in interrupted]
    return {
        "trees_committed": trees["total"],
        "trees_trained": len(trained),
        "batches": len(batches),
        "trees_lost": sum(t not in held for t in trained) + in_no_state,
        "trees_duplicated": len(trained) - len(set(trained)) + len(repeats),
        "trees_half_visible": len(corrupt) + sum(1 for r in report if r["committed"]),
        "interrupted_commits": len(interrupted),
        "quarantined": stats["quarantined"],
    }


def verify_lines(store_dir: Path) -> tuple[list[str], list[str]]:
    """(errors, the last line `treeopsd store verify` prints) for the store: the same check, in-process."""
    from storage.store_verify import verify_store

    result = verify_store(store_dir)
    if not result.ok:
        return result.errors, [f"ERROR {result.errors[-1]}"]
    trees, segments = result.stats["trees"]["total"], result.stats["segments"]["total"]
    return [], [f"ok: {trees} trees in {segments} segments decode and validate"]


def verdict(
    steps: int,
    returncode: int,
    plan: Sequence[tuple[int, str]] | None,
    kills: Sequence[tuple[Any, str, int]],
    trained: Mapping[int, int],
    batches: Sequence[Sequence[str]],
    store_errors: Sequence[str],
    store: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every check of a campaign, each True/False, and `ok` when all hold. `plan` (the drill's, each role
    once): the kills done match it; `store` (audit_store's figures): no tree lost, duplicated or
    half-visible. Batch k is the k-th the store handed out; `trained` maps each step to its batch."""
    trees = [t for ids in batches for t in ids]
    counts = Counter(trained.values())
    checks = {"exit_0": returncode == 0}
    if plan is not None:
        checks["each_role_killed_once"] = sorted(r for _, r, _ in kills) == sorted(r for _, r in plan)
    checks |= {
        "reached_all_steps": sorted(trained) == list(range(1, steps + 1)),
        "every_batch_trained_once": sorted(trained.values()) == list(range(steps)),
        "store_batches_match": len(batches) == steps,
        "no_tree_in_two_batches": len(trees) == len(set(trees)),
        "store_verify_clean": not store_errors,
    }
    if store is not None:
        kept = (store["trees_lost"], store["trees_duplicated"], store["trees_half_visible"]) == (0, 0, 0)
        checks["no_tree_lost_duplicated_or_half_visible"] = kept
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "batches_trained_twice": sorted(k for k, c in counts.items() if c > 1),
        "batches_skipped": sorted(set(range(steps)) - set(counts)),
    }


def audit_run(
    run_dir: Path,
    steps: int | None,
    returncode: int,
    plan: Sequence[tuple[int, str]] | None = None,
    kills: Sequence[tuple[Any, str, int]] = (),
) -> dict[str, Any]:
    """The report both commands share, from the run's files: the verdict over `steps` (None: the steps the
    run says it reached in summary.json, for a run stopped on a clock), and the figures it rests on."""
    summary_path = run_dir / "summary.json"  # the run's own account of its steps and restarts
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    steps = int(summary.get("steps", 0)) if steps is None else steps
    store_dir = run_dir / "store"
    errors, verify = verify_lines(store_dir)
    try:
        store: dict[str, Any] | None = audit_store(store_dir)
        batches = live_batches(store_dir)
    except (OSError, StoreError) as e:  # no store at all: the run died before it opened one
        store, batches = None, []
        errors = errors or [f"{store_dir}: {e}"]
    trained = lineage(read_batch_index_events(run_dir / "tb"))
    found = verdict(steps, returncode, plan, kills, trained, batches, errors, store)
    return {
        **found,
        "steps": steps,
        "returncode": returncode,
        "steps_trained": len(trained),
        "steps_without_metrics": sorted(set(range(1, steps + 1)) - set(trained)),  # trained or not: unknown
        "store_batches": len(batches),
        "batches_handed_out_not_trained": len(batches) - steps,
        "store": store,
        "store_verify": verify,
        "restarts": {**summary.get("restarts", {}), "sampler": summary.get("sampler_restarts")},
        "learner_step_retries": summary.get("learner_step_retries"),
        "batch_audit": batch_audit(summary.get("batch_events", []), steps),  # the run's own record of them
        "checkpoint": summary.get("checkpoint"),
    }


def trained_batches(events: Sequence[tuple[str, int]]) -> list[int]:
    """The batch indices the model holds, in training order, after applying the rewinds."""
    out: list[int] = []
    for op, k in events:
        if op in ("trained", "unlogged"):
            out.append(k)
        elif op == "rewind":
            out = [b for b in out if b < k]
        else:
            raise ValueError(f"unknown batch event {op!r}")
    return out


def batch_audit(events: Sequence[tuple[str, int]], steps: int) -> dict[str, list[int] | int]:
    """Batches trained twice and batches skipped on the way to `steps` steps (both empty in a sound run)."""
    held = trained_batches(events)
    counts = Counter(held)
    return {
        "trained": len(held),
        "twice": sorted(k for k, c in counts.items() if c > 1),
        "skipped": sorted(set(range(steps)) - set(counts)),
        "unlogged": sorted(k for op, k in events if op == "unlogged"),
    }
