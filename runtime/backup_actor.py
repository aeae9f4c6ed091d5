"""The backup role's Ray shell: `BackupWorker` plus the pid of its process. A module of its own, light to
import: a Ray worker imports the module that defines its actor class, and the backup needs no torch."""

from __future__ import annotations

import os

from actors.backup_worker import BackupWorker


class BackupActor(BackupWorker):
    """The soak and the tests find it by its process title, `ray::BackupActor` (faults/soak.py)."""

    def pid(self) -> int:
        return os.getpid()
