"""`treeopsd drill`: the fire drill — `treeopsd train --steps N` as a child process, a sampler, the backup,
the store and the learner each SIGKILLed once at random moments, and then the run's own files checked.

    treeopsd drill --steps 300 --run-dir runs/drill [--seed 0] [--config X.yaml] [k=v ...]

Nothing is done for the run by hand: the child trains with its configured restart budgets and must reach step
N by itself and exit 0. The kill steps are drawn with `--seed` (faults/drill.py:kill_plan); each kill waits
until the store has handed out that many batches, then a further random 0–1 s, so it lands anywhere inside a
step. Afterwards: `treeopsd store verify` on the store; the learner's lineage of trained batches from its
metrics (`learner/batch_index` per step in tensorboard, a re-logged step undoing the later ones); the store's
live batches from its consumed log. The report — one JSON object, also RUN_DIR/drill.json — gives every check;
exit 0 when all hold.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=300, help="learner steps the run must reach")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill plan (steps, order, victims)")
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("--run-dir", default="runs/drill", help="a new run directory")
    parser.add_argument(
        "--results", default=None, help="also copy the report to DIR/drill.json (for make readme)"
    )
    parser.add_argument("--timeout-min", type=float, default=120.0, help="give up on the run after this")
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value, passed to train")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *args]


def _batches_handed_out(store_dir: Path) -> int:
    from faults.drill import live_batches
    from storage.store_files import LogError

    try:
        return len(live_batches(store_dir))
    except (OSError, LogError):  # not created yet, or a record being appended right now
        return 0


class _Child:
    """The training child and the drill's deadline: waits on a condition of its files while it runs."""

    def __init__(self, cmd: list[str], timeout_s: float) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        self.deadline = time.monotonic() + timeout_s

    def wait_until(self, cond: Any) -> bool:
        """True once `cond()` holds; False when the child exits or the deadline passes first."""
        while not cond():
            if self.proc.poll() is not None or time.monotonic() > self.deadline:
                return False
            time.sleep(0.2)  # polls the child's files: it is another process tree, with no event to wait on
        return True

    def kill_at(self, step: int, role: str, store_dir: Path, rng: random.Random) -> int | None:
        """Once `step` batches are handed out, and a random 0-1 s more: SIGKILLs one process of `role` (when
        it is down, restarting, once it is back); its pid, or None when the child ended first."""
        from faults.soak import kill_role

        if not self.wait_until(lambda: _batches_handed_out(store_dir) >= step):
            return None
        time.sleep(rng.uniform(0.0, 1.0))  # anywhere inside the step
        got: list[int] = []

        def killed() -> bool:
            pid = kill_role(role, rng, self.proc.pid)
            got.extend([pid] if pid is not None else [])
            return bool(got)

        return got[0] if self.wait_until(killed) else None


def run_with_kills(args: argparse.Namespace, plan: list[tuple[int, str]]) -> tuple[int, list[Any]]:
    """Starts the training child, kills per `plan`, waits; (its exit status, [(step, role, pid), ...])."""
    train = ["train", "--steps", str(args.steps), "--run-dir", args.run_dir, "--no-progress"]
    train += ["--config", args.config] if args.config else []
    child = _Child(_cli(*train, *args.overrides), args.timeout_min * 60)
    rng, kills, store_dir = random.Random(args.seed), [], Path(args.run_dir) / "store"
    try:
        for step, role in plan:
            pid = child.kill_at(step, role, store_dir, rng)
            if pid is None:
                break
            kills.append((step, role, pid))
            print(f"drill: killed the {role} (pid {pid}) at step {step}", flush=True)
        returncode = child.proc.wait(timeout=max(1.0, child.deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        child.proc.terminate()  # the run's own Ctrl-C path: a checkpoint, then exit
        returncode = child.proc.wait(timeout=120)
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
    return returncode, kills


def audit(args: argparse.Namespace, returncode: int, plan: list[Any], kills: list[Any]) -> dict[str, Any]:
    from faults.drill import drill_verdict, lineage, live_batches, read_batch_index_events

    run_dir = Path(args.run_dir)
    verify = subprocess.run(
        _cli("store", "verify", str(run_dir / "store")), cwd=ROOT, capture_output=True, text=True
    )
    errors = [] if verify.returncode == 0 else [verify.stdout.strip() or verify.stderr.strip()]
    trained = lineage(read_batch_index_events(run_dir / "tb"))
    batches = live_batches(run_dir / "store")
    verdict = drill_verdict(args.steps, returncode, plan, kills, trained, batches, errors)
    summary_path = run_dir / "summary.json"  # the run's own account of its restarts
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {
        **verdict,
        "steps": args.steps,
        "returncode": returncode,
        "plan": plan,
        "kills": kills,
        "steps_trained": len(trained),
        "store_batches": len(batches),
        "store_verify": verify.stdout.strip().splitlines()[-1:] if verify.stdout else errors,
        "restarts": {**summary.get("restarts", {}), "sampler": summary.get("sampler_restarts")},
        "learner_step_retries": summary.get("learner_step_retries"),
    }


def run(args: argparse.Namespace) -> int:
    from configs.schema import ConfigError, load_config
    from faults.drill import ROLES, kill_plan
    from storage.durable import write_atomic

    if os.environ.get("RAY_ADDRESS"):
        print("treeopsd drill: runs on local Ray only (it kills processes by pid); unset RAY_ADDRESS")
        return 2
    if (Path(args.run_dir) / "config.yaml").exists():
        print(f"treeopsd drill: {args.run_dir} already holds a run; pass a new --run-dir", file=sys.stderr)
        return 2
    try:
        plan = kill_plan(args.steps, ROLES, args.seed)
        load_config(args.config, [*args.overrides, f"run.steps={args.steps}"])  # refused before the child
    except ConfigError as e:  # a ValueError too: first
        print(f"treeopsd drill: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"treeopsd drill: --steps: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    returncode, kills = run_with_kills(args, plan)
    out = {**audit(args, returncode, plan, kills), "wall_s": round(time.monotonic() - t0, 1)}
    text = json.dumps(out, indent=2)
    write_atomic(Path(args.run_dir) / "drill.json", text.encode())
    if args.results:  # `make readme` renders docs/results.md's block from it (tools/fault_report.py)
        Path(args.results).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(args.results) / "drill.json", text.encode())
    print(text)
    return 0 if out["ok"] else 1
