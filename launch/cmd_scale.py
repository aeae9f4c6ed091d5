"""`treeopsd scale RUN_DIR --samplers N`: grow or shrink a running job's sampler pool.

The command writes RUN_DIR/control.json atomically ({"samplers": N, "seq": k}); the running driver polls it
between scheduling rounds. New samplers subscribe to the weight broadcast and start from the latest version;
removed ones get no new work and are stopped once their last call has committed its trees.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from storage.run_control import write_control


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run directory of a running `treeopsd train`")
    parser.add_argument("--samplers", type=int, required=True, help="number of sampler actors to run")


def request_scale(run_dir: str | os.PathLike, samplers: int) -> dict:
    from runtime.leftovers import driver_alive

    run = Path(run_dir)
    if not (run / "config.yaml").exists():
        raise ValueError(f"{run} is not a treeopsd run directory (no config.yaml)")
    if samplers < 1:
        raise ValueError(f"--samplers must be >= 1, got {samplers}")
    if driver_alive(run) is False:  # None: no record (a cluster run), the control file is the only way
        raise ValueError(f"{run} is not running (its driver has exited); nothing would read the request")
    return write_control(run, samplers)


def run(args: argparse.Namespace) -> int:
    try:
        control = request_scale(args.run_dir, args.samplers)
    except ValueError as e:
        print(f"treeopsd scale: {e}", file=sys.stderr)
        return 2
    print(json.dumps(control))
    return 0
