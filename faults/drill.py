"""The fire drill's parts (`treeopsd drill`, launch/cmd_drill.py): where each role is killed, and what the
run's own files say afterwards — the learner's lineage of trained batches and the store's live batches.

    plan = kill_plan(steps=300, roles=ROLES, seed=0)        # [(step, role), ...]: each role once
    lineage([(1, 0.0), (2, 1.0), (2, 1.0), (3, 2.0)])       # {1: 0, 2: 1, 3: 2}: a re-logged step replaces
    drill_verdict(...)                                      # the checks, each with its reason

Pure functions and file reads only: the drill's process handling is in launch/cmd_drill.py.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROLES = ("sampler", "backup", "store", "learner")


def kill_plan(steps: int, roles: Sequence[str], seed: int) -> list[tuple[int, str]]:
    """Each role once, at distinct random steps in the first half of the run (a kill at step k lands while
    batch k is trained: after k batches are handed out; the second half leaves the run time to heal, and a
    role that is down when its turn comes time to come back before the run ends), in random order; by step.
    """
    if steps < len(roles) + 1:
        raise ValueError(f"a drill of {len(roles)} kills needs at least {len(roles) + 1} steps, got {steps}")
    rng = random.Random(seed)
    last = max(len(roles), steps // 2)
    at = sorted(rng.sample(range(1, last + 1), len(roles)))
    order = rng.sample(list(roles), len(roles))
    return list(zip(at, order, strict=True))


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

    return read_scalars(tb_dir, purge=False).get("learner/batch_index", [])


def live_batches(store_dir: Path) -> list[list[str]]:
    """The store's live batches (tree ids), replayed from its consumed log (read-only)."""
    from storage.store_files import read_log, replay_log

    path = store_dir / "consumed.log"
    records, _, _ = read_log(path)
    return replay_log(records, path)


def drill_verdict(
    steps: int,
    returncode: int,
    plan: Sequence[tuple[int, str]],
    kills: Sequence[tuple[int, str, int]],
    trained: dict[int, int],
    batches: Sequence[Sequence[str]],
    store_errors: Sequence[str],
) -> dict[str, Any]:
    """Every check of the drill, each True/False, and `ok` when all hold."""
    trees = [t for ids in batches for t in ids]
    counts = Counter(trained.values())
    checks = {
        "exit_0": returncode == 0,
        "each_role_killed_once": sorted(r for _, r, _ in kills) == sorted(r for _, r in plan),
        "reached_all_steps": sorted(trained) == list(range(1, steps + 1)),
        "every_batch_trained_once": sorted(trained.values()) == list(range(steps)),
        "store_batches_match": len(batches) == steps,
        "no_tree_in_two_batches": len(trees) == len(set(trees)),
        "store_verify_clean": not store_errors,
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "batches_trained_twice": sorted(k for k, c in counts.items() if c > 1),
        "batches_skipped": sorted(set(range(steps)) - set(counts)),
    }
