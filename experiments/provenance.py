"""Where a result came from (commit, machine, time), and writing result files atomically."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from storage.durable import write_atomic


def _git(*cmd: str) -> str | None:
    try:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def commit() -> str:
    """Short HEAD hash, marked when tracked files have uncommitted changes; "unknown" outside git."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return "unknown"
    return head + (" (+ uncommitted changes)" if is_dirty() else "")


def is_dirty() -> bool:
    """Tracked files differ from HEAD (untracked files, such as runs/, do not count)."""
    return bool(_git("status", "--porcelain", "--untracked-files=no"))


class DirtyTree(Exception):
    """A results file asked for from uncommitted code: the message is the one line to print."""


def require_clean(allow_dirty: bool) -> dict[str, Any]:
    """The provenance stamp of a results file, checked before anything runs: the commit and whether the tree
    was clean. A dirty tree is refused (DirtyTree) unless `allow_dirty`, and then the stamp says so."""
    dirty = is_dirty()
    if dirty and not allow_dirty:
        raise DirtyTree(
            "the working tree has uncommitted changes (git status): results files are written from a "
            "clean commit; commit first, or pass --allow-dirty (the results then say they are not)"
        )
    note = (
        "written from uncommitted changes (--allow-dirty): not reproducible from the commit" if dirty else ""
    )
    return {"commit": commit(), "clean": not dirty, "note": note}


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return platform.machine() or "unknown"
    lines = cpuinfo.read_text().splitlines()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def write_json(path: Path, data: Any) -> None:
    """Durably (storage/durable.py): a reader sees the old file or the whole new one."""
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=float).encode())
