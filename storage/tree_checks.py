"""The rules of `system.tree.validate_tree`, checked on a whole record batch at once (numpy over the flat
columns, no Python object per node): what the store runs on every commit and every full reopen.

    check_trees(batch, flat_columns(batch))     # raises TreeValidationError / TreeCodecError when bad

Rules (per tree): rows in node-id order 0..n−1 (how `encode_trees` writes them); one root (row 0, parent −1,
depth 0, no tokens, no reward); every other parent inside the tree and depth = parent's depth + 1 (which
also rules out cycles: depth falls by one per step towards the root); tokens, loss mask and log-probs of a
turn equally long; token ids ≥ 0; no finite behavior log-prob above 1e-4 on a loss token; versions ≥ 0;
internal turns without a reward, leaves with a finite one; credit on all nodes of a tree or none; the
tree's meta is JSON. When a rule fails, the same batch is decoded tree by tree (`decode_trees`), so the
error names the tree, the node and the rule exactly as `validate_tree` words it.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from storage.tree_codec import FlatColumns, ListColumn, TreeCodecError, as_arrow, decode_trees
from system.tree import TreeValidationError

MAX_LOGPROB = 1e-4  # as validate_tree: a log-probability is never above 0 (with room for rounding)


def check_trees(batch: pa.RecordBatch, f: FlatColumns) -> None:
    """Raises if any tree of `batch` breaks a rule (module docstring); `f` is `flat_columns(batch)`."""
    broken = _first_broken_rule(batch, f)
    if broken is not None:
        decode_trees(batch)  # names the tree, node and rule (validate_tree's own words)
        raise TreeValidationError(f"a tree breaks the rule: {broken}")


def _values(col: ListColumn) -> np.ndarray:
    """The flat values of all rows of a list column, in row order."""
    return col.values[int(col.offsets[0]) : int(col.offsets[-1])] if len(col.offsets) else col.values[:0]


def _first_broken_rule(batch: pa.RecordBatch, f: FlatColumns) -> str | None:
    n, starts = f.num_rows, f.tree_starts
    if n == 0:
        return None
    sizes = np.diff(starts)
    tree = np.repeat(np.arange(len(sizes)), sizes)
    local = np.arange(n) - starts[:-1][tree]
    root = local == 0
    if (sizes < 2).any():
        return "a tree needs a root and at least one turn"
    if (f.node_id != local).any():
        return "node ids must be 0..n-1 in row order"
    if (f.parent[root] != -1).any() or (f.parent[~root] < 0).any() or (f.parent >= sizes[tree]).any():
        return "exactly one root (node 0, parent -1) and every parent inside its tree"
    parent_row = np.where(root, 0, starts[:-1][tree] + f.parent)
    if (f.depth[root] != 0).any() or (f.depth[~root] != f.depth[parent_row[~root]] + 1).any():
        return "depth 0 at the root and parent depth + 1 below it"
    if (f.tokens.lengths[root] != 0).any() or not np.isnan(f.reward[root]).all():
        return "the root has no turn tokens and no reward"
    return _turn_rule(batch, f, root, parent_row)


def _turn_rule(batch: pa.RecordBatch, f: FlatColumns, root: np.ndarray, parent_row: np.ndarray) -> str | None:
    size = f.tokens.lengths
    if (f.loss_mask.lengths != size).any() or (f.behavior_logprobs.lengths != size).any():
        return "tokens, loss_mask and behavior_logprobs of a turn have the same length"
    tokens = _values(f.tokens)
    if tokens.size and int(tokens.min()) < 0:
        return "token ids are non-negative"
    lp, mask = _values(f.behavior_logprobs), _values(f.loss_mask)
    if (mask & np.isfinite(lp) & (lp > MAX_LOGPROB)).any():
        return "no behavior log-prob > 0 on a loss token"
    if (f.policy_version[~root] < 0).any():
        return "policy_version >= 0 on every turn"
    has_child = np.zeros(f.num_rows, dtype=bool)
    has_child[parent_row[~root]] = True
    turn = ~root
    if not np.isnan(f.reward[turn & has_child]).all() or not np.isfinite(f.reward[turn & ~has_child]).all():
        return "internal turns carry no reward and leaves a finite one"
    per_tree = np.add.reduceat(f.has_credit.astype(np.int64), f.tree_starts[:-1])
    if ((per_tree != 0) & (per_tree != np.diff(f.tree_starts))).any():
        return "credit on every node of a tree or on none"
    return _meta_rule(batch, f)


def _meta_rule(batch: pa.RecordBatch, f: FlatColumns) -> str | None:
    roots = as_arrow(f.tree_starts[:-1].astype(np.int64), pa.int64())
    for meta in batch.column("meta").take(roots).to_pylist():
        try:
            if meta and not isinstance(json.loads(meta), dict):
                return "the tree's meta is a JSON object"
        except json.JSONDecodeError as e:
            raise TreeCodecError(f"bad meta JSON ({e})") from e
    return None
