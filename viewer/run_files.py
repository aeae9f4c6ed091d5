"""What a run directory holds, as the viewer reads it (never writes, never locks).

    run = RunFiles.open("runs/x")   # ViewError (one line) when the folder is not a run
    run.cfg                          # the run's resolved config (config.yaml), or None with a note
    run.store                        # the replay store's directory
    run.batches()                    # tree id -> batch k that trained it (consumed.log, read-only)
    run.writer()                     # "pid 1234" while a process holds the store's writer lock, else None
    run.tokenizer_dir()              # the newest checkpoint with tokenizer files, else model.path

A run directory is what `treeopsd train` / `demo` write (README "Run directory"): config.yaml and
store/ (or store.dir); a bare replay store is accepted too (then there is no config: stored credit only).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from configs.schema import Config, ConfigError, load_config
from storage import store_files as sf

CHECKPOINT_RE = re.compile(r"^step_(\d{6,})$")


class ViewError(RuntimeError):
    """A folder or file the viewer cannot use; the message is the one line the user sees."""


@dataclass
class RunFiles:
    root: Path
    store: Path
    cfg: Config | None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, directory: str | os.PathLike) -> RunFiles:
        root = Path(directory)
        if not root.is_dir():
            what = "does not exist" if not root.exists() else "is not a directory"
            raise ViewError(f"{root}: {what}; expected a run directory (config.yaml, store/)")
        if (root / sf.MARKER).exists():  # a bare store
            return cls(root, root, None, ["a bare replay store: no config.yaml, so only stored credit shows"])
        config = root / "config.yaml"
        if not config.exists():
            raise ViewError(
                f"{root}: not a run directory (no config.yaml, no store/{sf.MARKER}); "
                "pass the folder `treeopsd train --run-dir` or `treeopsd demo` wrote"
            )
        cfg, notes = _config(config)
        store = root / "store"
        if cfg is not None and cfg.store.dir:
            store = Path(cfg.store.dir)  # as the run named it (a relative path: from where it started)
        return cls(root, store, cfg, notes)

    def store_state(self) -> str | None:
        """None when the store is readable; else the line that says why there are no trees yet."""
        try:
            sf.init_or_check(self.store, create=False)
        except sf.StoreError as e:
            return f"{e} (a run that has not committed its first trees yet?)"
        return None

    def batches(self) -> tuple[dict[str, int], str | None]:
        """(tree id -> batch index, a problem line or None) from consumed.log, read as the store reads it."""
        path = self.store / "consumed.log"
        try:
            records, _, _ = sf.read_log(path)  # a torn last record is an append in flight: left out
            batches = sf.replay_log(records, path)
        except (OSError, sf.StoreError) as e:
            return {}, f"{path}: {e}"
        return {t: k for k, ids in enumerate(batches) for t in ids}, None

    def writer(self) -> str | None:
        """Who holds the store's writer lock (a running job), from /proc/locks: no lock is taken here, so
        a job starting or resuming meanwhile is never refused."""
        try:
            st = os.stat(self.store / "LOCK")
            table = Path("/proc/locks").read_text()
        except OSError:
            return None
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in table.splitlines():
            parts = line.split()
            if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == dev:
                return f"pid {parts[4]}"
        return None

    def tokenizer_dir(self) -> Path | None:
        """Where the run's tokenizer is: the newest checkpoint folder holding one, else model.path."""
        ckpts = self.root / "checkpoints"
        steps = sorted(p for p in ckpts.iterdir() if CHECKPOINT_RE.match(p.name)) if ckpts.is_dir() else []
        for step in reversed(steps):
            if (step / "tokenizer_config.json").exists():
                return step
        path = self.cfg.model.path if self.cfg is not None else None
        if path and Path(path).exists():
            return Path(path)
        return None

    def summary(self) -> dict[str, Any]:
        algo = self.cfg.algo if self.cfg is not None else None
        return {
            "run_dir": str(self.root.resolve()),
            "name": self.cfg.run.name if self.cfg is not None else self.root.name,
            "method": algo.method if algo else None,
            "rho": algo.rho if algo else None,
            "notes": list(self.notes),
        }


def _config(path: Path) -> tuple[Config | None, list[str]]:
    """The run's config; a config.yaml this build cannot load is a note (stored credit still shows)."""
    try:
        return load_config(path), []
    except ConfigError as e:
        return None, [f"{path}: {e}; credit is shown only where the store holds it"]
