"""Per-role log files: every actor of a run writes RUN_DIR/logs/<role>-<i>.log, so a failure can be read
(and is named by the driver, runtime/driver.py) without digging through Ray's session folders.

    path = setup_role_log(run_dir, "sampler", 0)     # first thing in an actor (runtime/remote.py:RoleHost)

Python logging goes to the file (INFO and up, appended: a restarted actor continues its log), and so does
the process's stderr (file descriptor 2), which child processes inherit: the vLLM engine core and its
workers, whose tracebacks would otherwise stay in Ray's worker logs.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"


def role_log_path(run_dir: str | os.PathLike[str], role: str, index: int = 0) -> Path:
    return Path(run_dir) / "logs" / f"{role}-{index}.log"


def setup_role_log(
    run_dir: str | os.PathLike[str], role: str, index: int = 0, redirect_stderr: bool = True
) -> Path:
    """Sends this process's logging (and stderr) to the role's log file; returns its path."""
    path = role_log_path(run_dir, role, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    if not any(getattr(h, "treeopsd_role_log", None) == str(path) for h in root.handlers):
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.treeopsd_role_log = str(path)  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.setLevel(min(root.level or logging.INFO, logging.INFO))
    if redirect_stderr:
        sys.stderr.flush()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)  # fd 2 itself: C extensions and child processes write there too
        os.close(fd)
    logging.getLogger(__name__).info("%s-%d started (pid %d)", role, index, os.getpid())
    return path
