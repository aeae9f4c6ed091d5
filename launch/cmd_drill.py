"""`treeopsd drill`: the fire drill — `treeopsd train --steps N` as a child process, a sampler, the backup,
the store and the learner each SIGKILLed once at random moments, and then the run's own files checked.

    treeopsd drill --steps 300 --run-dir runs/drill [--seed 0] [--config X.yaml] [k=v ...]

Nothing is done for the run by hand: the child trains with its configured restart budgets and must reach step
N by itself and exit 0. The kill steps are drawn with `--seed` (faults/campaign.py:kill_plan); each kill waits
until the store has handed out that many batches, then a further random 0–1 s, so it lands anywhere inside a
step. Afterwards (faults/audit.py, as for `treeopsd soak`): `treeopsd store verify`'s check on the store; the
learner's lineage of trained batches from its metrics (`learner/batch_index` per step in tensorboard, a
re-logged step undoing the later ones); the store's live batches from its consumed log and its trees. The
report — one JSON object, also RUN_DIR/drill.json — gives every check; exit 0 when all hold.

    treeopsd drill --nodes 3 --kill-node learner@4,store@9 --steps 16 --run-dir runs/node-drill

With --nodes: whole nodes instead of single processes (faults/nodes.py). A fake cluster on this machine — a
head with no CPUs and N worker nodes in pools train (learner, backup), store and sample — and the run on it;
at each ROLE@STEP of --kill-node, every process of the node hosting ROLE is SIGKILLed and a node with the same
resources joins a few seconds later. The report (RUN_DIR/drill.json) adds the node checks: the run healed or
stopped with one line, no batch trained twice, `store verify` clean, no committed tree lost, no process of a
killed node left.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from faults.node_plan import KILL_NODE_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=300, help="learner steps the run must reach")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill plan (steps, order, victims)")
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("--run-dir", default="runs/drill", help="a new run directory")
    parser.add_argument(
        "--results", default=None, help="also copy the report to DIR/drill.json (for make readme)"
    )
    parser.add_argument("--timeout-min", type=float, default=120.0, help="give up on the run after this")
    parser.add_argument(
        "--nodes", type=int, default=None, help="run on a fake cluster of this many worker nodes (>= 3)"
    )
    parser.add_argument("--kill-node", default=None, metavar="SPEC", help=f"with --nodes: {KILL_NODE_HELP}")
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value, passed to train")


def run(args: argparse.Namespace) -> int:
    from faults.audit import audit_run
    from faults.campaign import AtSteps, kill_plan, refused, run_campaign, train_command, write_report
    from faults.processes import ROLES

    if args.nodes is not None or args.kill_node is not None:
        return _run_nodes(args)
    problem = refused("drill", args.run_dir, args.config, [*args.overrides, f"run.steps={args.steps}"])
    try:
        plan = kill_plan(args.steps, ROLES, args.seed)
    except ValueError as e:
        problem = problem or f"treeopsd drill: --steps: {e}"
    if problem:
        print(problem, file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    child = train_command(run_dir, args.steps, args.config, args.overrides)
    got = run_campaign(child, run_dir, AtSteps(plan, args.seed), args.timeout_min * 60, name="drill")
    out = audit_run(run_dir, args.steps, got.returncode, plan, got.kills)
    out |= {"plan": plan, "kills": got.kills, "wall_s": got.wall_s}
    print(write_report(out, "drill.json", run_dir, args.results))
    return 0 if out["ok"] else 1


def _run_nodes(args: argparse.Namespace) -> int:
    """`treeopsd drill --nodes N --kill-node SPEC` (module docstring)."""
    from faults.campaign import refused, train_command, write_report
    from faults.node_plan import node_layout, parse_kill_nodes, pool_overrides
    from faults.nodes import run_node_drill

    overrides = [*args.overrides, *pool_overrides()]
    problem = refused("drill", args.run_dir, args.config, [*overrides, f"run.steps={args.steps}"])
    try:
        if args.nodes is None or args.kill_node is None:
            raise ValueError("--nodes and --kill-node go together")
        plan, layout = parse_kill_nodes(args.kill_node, args.steps), node_layout(args.nodes)
    except ValueError as e:
        problem = problem or f"treeopsd drill: {e}"
    if problem:
        print(problem, file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    child = train_command(run_dir, args.steps, args.config, overrides)
    out = run_node_drill(run_dir, args.steps, plan, layout, child, args.seed, args.timeout_min * 60)
    print(write_report(out, "drill.json", run_dir, args.results))
    return 0 if out["ok"] else 1
