"""RUN_DIR/control.json: how `treeopsd scale` (launch/cmd_scale.py) asks a running driver for N samplers; the
driver polls it each tick (runtime/driver.py). Written atomically, each request with the next `seq`.

    write_control(run_dir, samplers=3)      # {"samplers": 3, "seq": 1}
    read_control(run_dir)                   # the same dict, or None when there is none
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from storage.durable import write_atomic

log = logging.getLogger(__name__)
CONTROL_FILE = "control.json"


def read_control(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The last request, or None when there is none (an unreadable file is logged and ignored)."""
    path = Path(run_dir) / CONTROL_FILE
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return None


def write_control(run_dir: str | os.PathLike[str], samplers: int) -> dict[str, Any]:
    """A new request for `samplers` samplers, one `seq` past the last; what was written."""
    control = {"samplers": samplers, "seq": int((read_control(run_dir) or {}).get("seq", 0)) + 1}
    write_atomic(Path(run_dir) / CONTROL_FILE, json.dumps(control).encode(), unique=True)  # never half-read
    return control
