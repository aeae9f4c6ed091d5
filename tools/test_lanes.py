"""`make test` as two pytest processes side by side: the lane of single-process tests (CPU-bound, one
thread each: `-m "not slow and not ray and not vllm"`) and the lane of the rest (local Ray, the vLLM
engine, multi-process runs: mostly processes waiting on each other). On the 2-core CI machine the second
lane leaves about a core idle, which the first lane fills: the suite takes about the second lane's time
instead of the sum. Each lane is still one pytest session, so the slow lane keeps sharing its one Ray
instance and its one vLLM engine.

    python tools/test_lanes.py            # both lanes; exit status 0 only when both pass
    python tools/test_lanes.py -x -k foo  # extra pytest arguments go to both lanes

The slow lane writes to the terminal as it runs; the quick lane's output goes to a log file
(`TREEOPSD_QUICK_LOG`, default /tmp/treeopsd-quick-lane.log) and is printed when that lane ends, so the two
never interleave. Each lane has its own pytest base temporary directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUICK = "not slow and not ray and not vllm"
SLOW = "slow or ray or vllm"


def lane_command(marker: str, basetemp: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-m", marker, f"--basetemp={basetemp}", *extra]


def main(extra: list[str]) -> int:
    root = Path(tempfile.mkdtemp(prefix="treeopsd-lanes-"))
    log_path = Path(os.environ.get("TREEOPSD_QUICK_LOG", "/tmp/treeopsd-quick-lane.log"))
    t0 = time.monotonic()
    with log_path.open("w") as log:
        quick = subprocess.Popen(
            lane_command(QUICK, root / "quick", extra), stdout=log, stderr=subprocess.STDOUT
        )
        slow_rc = subprocess.call(lane_command(SLOW, root / "slow", extra))
        quick_rc = quick.wait()
    print(f"\n==== quick lane ({QUICK}), log {log_path} ====", flush=True)
    sys.stdout.write(log_path.read_text())
    took = time.monotonic() - t0
    print(f"\n==== lanes: slow exit {slow_rc}, quick exit {quick_rc}; {took / 60:.1f} min in all ====")
    return _combined(slow_rc, quick_rc)


def _combined(slow_rc: int, quick_rc: int) -> int:
    """Exit status of the whole: 0 when both passed; pytest's 5 (no test selected, e.g. a -k that matches
    only one lane) counts as passed for that lane unless both selected nothing."""
    codes = [rc for rc in (slow_rc, quick_rc) if rc != 5]
    if not codes:
        return 5
    return next((rc for rc in codes if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
