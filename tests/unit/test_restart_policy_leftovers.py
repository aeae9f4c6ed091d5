"""After a SIGKILL of the driver, the next run in the same directory kills exactly what the dead one left
(runtime/leftovers.py): recorded pids with the same start time, only once the recorded driver is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from runtime.leftovers import RECORD, reap_dead_run, record_local_ray
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
# a "driver" that starts a long-lived child, records itself, prints the child's pid and dies without cleanup
DRIVER = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the pipes close with us
from runtime.leftovers import record_local_ray
record_local_ray(sys.argv[1])
print(child.pid, flush=True)
os._exit(0)
"""


def test_the_next_run_kills_what_a_dead_driver_left_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    orphan = int(out.stdout.split()[0])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # not recorded
    try:
        assert os.path.exists(f"/proc/{orphan}")  # the dead driver's child lives on
        assert reap_dead_run(tmp_path) == [orphan]
        wait_until(lambda: not _alive(orphan))  # SIGKILL is delivered, the exit is not instant
        assert bystander.poll() is None
        assert not (tmp_path / RECORD).exists() and reap_dead_run(tmp_path) == []  # nothing twice
    finally:
        bystander.kill()
        bystander.wait()


def test_a_live_driver_and_a_reused_pid_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        record_local_ray(tmp_path)  # this process is the recorded driver, and alive
        assert child.pid in dict(json.loads((tmp_path / RECORD).read_text())["processes"])
        assert reap_dead_run(tmp_path) == [] and child.poll() is None
        body = {"driver": [2**22 + 1, 0], "processes": [[child.pid, 1]]}  # a dead driver; start time differs
        (tmp_path / RECORD).write_text(json.dumps(body))
        assert reap_dead_run(tmp_path) == [] and child.poll() is None
    finally:
        child.kill()
        child.wait()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a killed orphan may stay a zombie until init reaps it
