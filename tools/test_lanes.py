"""`make test` as four pytest processes side by side: the tests on local Ray in two lanes, each with a Ray
instance of its own (roles in their own processes, mostly waiting on each other), the other slow and vLLM
tests (`-m "not ray and (slow or vllm)"`: the shared vLLM engine, multi-process learners) and the
single-process tests (CPU-bound, one thread each: `-m "not slow and not ray and not vllm"`). On the 2-core
CI machine a Ray lane leaves most of a core idle, which the others fill: the suite takes about its longest
lane's time instead of the sum. The second Ray lane holds the tests that run `treeopsd` as a child process
or start a cluster of their own, plus the real-model run, so the two Ray lanes take about as long. Each
lane is one pytest session: a Ray lane keeps one Ray instance, the slow lane one vLLM engine.

    python tools/test_lanes.py            # every lane; exit status 0 only when all pass
    python tools/test_lanes.py -x -k foo  # extra pytest arguments go to every lane

The first lane writes to the terminal as it runs; the other lanes' output goes to log files
(`TREEOPSD_LANE_LOGS`, default /tmp: treeopsd-lane-<name>.log) printed when all have ended, so they never
interleave. Each lane has its own pytest base temporary directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Ray tests of the second Ray lane: `treeopsd` child processes and clusters of their own (each starts its own
# Ray, so they gain nothing from sharing the lane's instance), and the real-model run to even out the time.
RAY_OWN = [
    "tests/ray/test_drill_cli.py",
    "tests/ray/test_node_drill.py",
    "tests/ray/test_supervision_signals.py",
    "tests/ray/test_supervision_soak.py",
    "tests/ray/test_external_train.py",
    "tests/ray/test_two_node_pools.py",
    "tests/ray/test_learner_two_nodes.py",
    "tests/ray/test_store_actor.py",
    "tests/ray/test_real_model_e2e.py",
]

LANES = {  # name -> pytest selection; the first lane writes to the terminal
    "ray": ["-m", "ray", *(f"--ignore={path}" for path in RAY_OWN)],
    "ray-own": ["-m", "ray", *RAY_OWN],
    "slow": ["-m", "not ray and (slow or vllm)"],
    "quick": ["-m", "not slow and not ray and not vllm"],
}


def lane_command(selection: list[str], basetemp: Path, extra: list[str]) -> list[str]:
    # the slowest tests of each lane are listed at its end: where the next minutes of CI time go
    pytest = [sys.executable, "-m", "pytest", "-q"]
    return [*pytest, *selection, f"--basetemp={basetemp}", "--durations=15", *extra]


def main(extra: list[str]) -> int:
    root = Path(tempfile.mkdtemp(prefix="treeopsd-lanes-"))
    log_dir = Path(os.environ.get("TREEOPSD_LANE_LOGS", tempfile.gettempdir()))
    (first, first_selection), *others = LANES.items()
    t0 = time.monotonic()
    logs = {name: log_dir / f"treeopsd-lane-{name}.log" for name, _ in others}
    handles = {name: path.open("w") for name, path in logs.items()}
    procs = {
        name: subprocess.Popen(
            lane_command(selection, root / name, extra), stdout=handles[name], stderr=subprocess.STDOUT
        )
        for name, selection in others
    }
    codes = {first: subprocess.call(lane_command(first_selection, root / first, extra))}
    codes.update({name: proc.wait() for name, proc in procs.items()})
    for name, path in logs.items():
        handles[name].close()
        print(f"\n==== lane {name} ({' '.join(LANES[name])}), log {path} ====", flush=True)
        sys.stdout.write(path.read_text())
    took = time.monotonic() - t0
    exits = ", ".join(f"{name} exit {rc}" for name, rc in codes.items())
    print(f"\n==== lanes: {exits}; {took / 60:.1f} min in all ====")
    return combined(list(codes.values()))


def combined(exit_codes: list[int]) -> int:
    """Exit status of the whole: 0 when every lane passed; pytest's 5 (no test selected, e.g. a -k that
    matches only one lane) counts as passed for that lane unless no lane selected anything."""
    codes = [rc for rc in exit_codes if rc != 5]
    if not codes:
        return 5
    return next((rc for rc in codes if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
