"""The tree list's rows, computed from one segment's columns without decoding a tree.

    rows = segment_rows(path, seq, kind)     # one dict per tree; raises BAD_SEGMENT errors

Each row: id, task (meta task_id, else prompt_id), dataset, nodes, turns, leaves, branch points (turns or
the prompt with two or more children), depth, tokens, leaf-reward min/max/mean/sd (ddof = 1, as credit
standardizes), no_signal (K < 2 or sd below system.credit.ZERO_STD: z ≡ 0, so V ≡ 0 and q ≡ 1/2),
truncated (an episode ended by the token limit or by env.max_turns: meta "finish"), the sampling versions,
whether the copy holds credit, and where it lives (segment, record batch, rows) for the detail read.
Only the small columns and the list offsets are touched: token values are never read here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from storage.store_files import read_segment
from storage.tree_codec import FlatColumns, flat_columns
from system.credit import ZERO_STD

CUT_FINISHES = ("truncated", "max_turns")  # actors/agent_loop.py: cut at the token limit / at env.max_turns


def segment_rows(path: Path, seq: int, kind: str) -> list[dict[str, Any]]:
    _, batches = read_segment(path)
    rows: list[dict[str, Any]] = []
    for bi, batch in enumerate(batches):
        if batch.num_rows:
            rows.extend(batch_rows(batch, seq, bi, kind))
    return rows


def _tree_of_rows(f: FlatColumns) -> np.ndarray:
    return np.repeat(np.arange(len(f.tree_starts) - 1), np.diff(f.tree_starts))


def batch_rows(batch: pa.RecordBatch, seq: int, bi: int, kind: str) -> list[dict[str, Any]]:
    f = flat_columns(batch)
    starts = f.tree_starts
    tree = _tree_of_rows(f)
    turn = f.parent >= 0
    parent_row = np.where(turn, starts[tree] + f.parent, -1)
    kids = np.bincount(parent_row[turn], minlength=f.num_rows)
    leaf = turn & (kids == 0)
    tokens = f.tokens.lengths + f.obs_tokens.lengths
    roots = starts[:-1]
    metas = batch.column("meta").take(pa.array(roots)).to_pylist()
    prompts = batch.column("prompt_id").take(pa.array(roots)).to_pylist()
    out = []
    for k, tid in enumerate(f.tree_ids):
        r0, r1 = int(starts[k]), int(starts[k + 1])
        meta = _meta(metas[k])
        rewards = f.reward[r0:r1][leaf[r0:r1]]
        versions = f.policy_version[r0:r1][turn[r0:r1]]
        out.append(
            {
                "id": tid,
                "task": str(meta.get("task_id") or prompts[k]),
                "dataset": str(meta.get("dataset", "")),
                "nodes": r1 - r0,
                "turns": int(turn[r0:r1].sum()),
                "leaves": int(rewards.size),
                "branch_points": int((kids[r0:r1] >= 2).sum()),
                "depth": int(f.depth[r0:r1].max()),
                "tokens": int(tokens[r0:r1].sum()),
                **reward_stats(rewards),
                "truncated": _cut(meta),
                "v_min": int(versions.min()) if versions.size else 0,
                "v_max": int(versions.max()) if versions.size else 0,
                "credited": bool(f.has_credit[r0]),
                "kind": kind,
                "loc": (seq, bi, r0, r1),
                "row0": r0,
            }
        )
    return out


def reward_stats(rewards: np.ndarray) -> dict[str, Any]:
    finite = rewards[np.isfinite(rewards)]
    if not finite.size:
        return {"r_min": None, "r_max": None, "r_mean": None, "r_sd": None, "no_signal": True}
    sd = float(np.std(finite, ddof=1)) if finite.size > 1 else 0.0
    return {
        "r_min": float(finite.min()),
        "r_max": float(finite.max()),
        "r_mean": float(finite.mean()),
        "r_sd": sd,
        "no_signal": bool(finite.size < 2 or sd < ZERO_STD),
    }


def _meta(text: str | None) -> dict[str, Any]:
    try:
        meta = json.loads(text) if text else {}
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def finishes(meta: dict[str, Any]) -> dict[str, str]:
    """leaf node id (as text) -> how its episode ended (the sampler's meta "finish"; {} if absent)."""
    try:
        value = json.loads(meta.get("finish", "{}"))
    except (TypeError, ValueError):
        return {}
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _cut(meta: dict[str, Any]) -> bool:
    return any(v in CUT_FINISHES for v in finishes(meta).values())
