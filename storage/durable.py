"""The one durable writer: every file that another process or a later run reads is written through here.

    write_atomic(path, data)              # bytes, or a function that writes into the open file
    publish_directory(tmp_dir, final)     # a directory filled by other code (save_pretrained) goes live

Protocol (docs/design.md §3): write a temp file beside the target, fsync it, rename it over the target (atomic
on POSIX: a reader sees the old file or the whole new one, never a part), fsync the directory (so the rename
itself survives a power cut). A crash leaves at most a `.tmp-` file, which its owner cleans up or
quarantines on the next open. `publish_directory` does the same for a whole directory: every file and
sub-directory fsynced, one rename, the parent fsynced.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_PREFIX = ".tmp-"
Writer = Callable[[BinaryIO], object]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(f: BinaryIO) -> None:
    """Flushes `f` and its inode's data to the device (tests wrap this to simulate a torn write)."""
    f.flush()
    os.fsync(f.fileno())


def temp_path(path: Path, unique: bool = False) -> Path:
    """`.tmp-<name>` beside `path` (with a random suffix when several writers may race for one name)."""
    suffix = f"-{uuid.uuid4().hex[:8]}" if unique else ""
    return path.with_name(f"{TMP_PREFIX}{path.name}{suffix}")


def write_atomic(
    path: str | os.PathLike[str], data: bytes | bytearray | memoryview | Writer, *, unique: bool = False
) -> int:
    """Writes `data` (bytes, or `data(file)` writing into the open binary file) durably at `path`: temp file,
    fsync, rename, fsync of the directory. Returns the file's size. `unique`: a random temp name, for files
    that several processes may write at once (the last rename wins, each a whole file)."""
    target = Path(path)
    tmp = temp_path(target, unique)
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            fsync_file(f)
        os.rename(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target.stat().st_size


def fsync_tree(root: Path) -> None:
    """fsync every file and directory below `root`, deepest first, then `root` itself."""
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_dir():
            fsync_dir(path)
        else:
            fd = os.open(path, os.O_RDONLY)  # fsync through any descriptor flushes the inode's data
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(root)


def publish_directory(tmp_dir: Path, final: Path) -> None:
    """Makes a fully written `tmp_dir` visible as `final` in one rename (`final` must not exist)."""
    fsync_tree(tmp_dir)
    os.rename(tmp_dir, final)
    fsync_dir(final.parent)
