"""`make test` as three lanes of pytest runs side by side: the tests on local Ray (`-m ray`: roles in their
own processes, mostly waiting on each other), the other slow and vLLM tests (`-m "not ray and (slow or
vllm)"`: the shared vLLM engine, multi-process learners) and the single-process tests (CPU-bound, one
thread each: `-m "not slow and not ray and not vllm"`). On the 2-core CI machine the Ray lane leaves part of
a core idle, which the others fill: the suite takes about its longest lane's time instead of the sum.

A lane is one or more pytest sessions in a row. The slow lane ends with Ray tests that need no shared
instance (OWN_INSTANCE: the real-model run, the CLI drill, the soak, Ctrl-C and resume, the node drill):
the slow and quick lanes' own tests end within about 9 minutes, and the Ray lane would otherwise run these
alone at the end; a Ray test run in its own session gets a Ray instance of its own (init_ray starts a local
one even beside another). Each session keeps one Ray instance or one vLLM engine. The last line gives each
lane's minutes: where to move tests next.

    python tools/test_lanes.py            # every lane; exit status 0 only when all pass
    python tools/test_lanes.py -x -k foo  # extra pytest arguments go to every session

The first lane writes to the terminal as it runs; the other lanes' output goes to log files
(`TREEOPSD_LANE_LOGS`, default /tmp: treeopsd-lane-<name>.log) printed when all have ended, so they never
interleave. Each session has its own pytest base temporary directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

Ended = tuple[int, float]  # a lane's exit status and its minutes

# Ray tests that start a Ray instance or cluster of their own (`treeopsd` as a child process, a fake
# multi-node cluster) or the real model: they go in any lane, and these follow the slow lane's own tests so
# that the two lanes end near each other (the last line of `make test` gives each lane's minutes).
OWN_INSTANCE = [
    "tests/ray/test_real_model_e2e.py",
    "tests/ray/test_drill_cli.py",
    "tests/ray/test_supervision_soak.py",
    "tests/ray/test_supervision_signals.py",
    "tests/ray/test_node_drill.py",
]

LANES = {  # name -> the pytest selections it runs one after the other; the first lane writes to the terminal
    "ray": [["-m", "ray", *(f"--ignore={path}" for path in OWN_INSTANCE)]],
    "slow": [["-m", "not ray and (slow or vllm)"], ["-m", "ray", *OWN_INSTANCE]],
    "quick": [["-m", "not slow and not ray and not vllm"]],
}


def lane_command(selection: list[str], basetemp: Path, extra: list[str]) -> list[str]:
    # the slowest tests of each session are listed at its end: where the next minutes of CI time go
    pytest = [sys.executable, "-m", "pytest", "-q"]
    return [*pytest, *selection, f"--basetemp={basetemp}", "--durations=15", *extra]


def run_lane(name: str, root: Path, extra: list[str], out: IO[str] | None, ended: dict[str, Ended]) -> None:
    """The lane's sessions in a row (each runs even when an earlier one failed); its combined exit status and
    its minutes."""
    results, t0 = [], time.monotonic()
    for i, selection in enumerate(LANES[name]):
        command = lane_command(selection, root / f"{name}-{i}", extra)
        results.append(subprocess.call(command, stdout=out, stderr=subprocess.STDOUT if out else None))
    ended[name] = (combined(results), (time.monotonic() - t0) / 60)


def main(extra: list[str]) -> int:
    root = Path(tempfile.mkdtemp(prefix="treeopsd-lanes-"))
    log_dir = Path(os.environ.get("TREEOPSD_LANE_LOGS", tempfile.gettempdir()))
    first, *others = LANES
    t0 = time.monotonic()
    logs = {name: log_dir / f"treeopsd-lane-{name}.log" for name in others}
    handles = {name: path.open("w") for name, path in logs.items()}
    ended: dict[str, Ended] = {}
    threads = [
        threading.Thread(target=run_lane, args=(name, root, extra, handles[name], ended)) for name in others
    ]
    for thread in threads:
        thread.start()
    run_lane(first, root, extra, None, ended)
    for thread in threads:
        thread.join()
    for name, path in logs.items():
        handles[name].close()
        sessions = " then ".join(" ".join(selection) for selection in LANES[name])
        print(f"\n==== lane {name} ({sessions}), log {path} ====", flush=True)
        sys.stdout.write(path.read_text())
    took = time.monotonic() - t0
    exits = ", ".join(f"{name} exit {ended[name][0]} in {ended[name][1]:.1f} min" for name in LANES)
    print(f"\n==== lanes: {exits}; {took / 60:.1f} min in all ====")
    return combined([ended[name][0] for name in LANES])


def combined(exit_codes: list[int]) -> int:
    """Exit status of the whole: 0 when every lane passed; pytest's 5 (no test selected, e.g. a -k that
    matches only one lane) counts as passed for that lane unless no lane selected anything."""
    codes = [rc for rc in exit_codes if rc != 5]
    if not codes:
        return 5
    return next((rc for rc in codes if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
