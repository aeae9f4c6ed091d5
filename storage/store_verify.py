"""`verify_store`: a read-only check of a replay store (what `treeopsd store verify` runs; moves nothing)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from storage.replay_store import ReplayStore, StoreError


@dataclass
class VerifyResult:
    ok: bool
    errors: list[str]
    notes: list[str]
    stats: dict[str, Any]


def verify_store(directory: str | os.PathLike) -> VerifyResult:
    """Read-only check (moves nothing): every committed segment decodes and every tree validates."""
    try:
        store = ReplayStore(directory, create=False, readonly=True)
    except StoreError as e:
        return VerifyResult(False, [str(e)], [], {})
    with store:
        report = store.recovery_report
        errors = [f"{r['file']}: {r['reason']}" for r in report if r["committed"]]
        notes = [f"{r['file']}: {r['reason']} (not a committed tree)" for r in report if not r["committed"]]
        return VerifyResult(not errors, errors, notes, store.stats())
