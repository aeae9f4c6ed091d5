"""The column-wise tree checks (storage/tree_checks.py) accept and reject what validate_tree does, with
validate_tree's own error message, on valid trees and on every kind of single-value corruption."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from store_writer import credited, make_tree

from storage.tree_checks import check_trees
from storage.tree_codec import SCHEMA, TreeCodecError, decode_trees, encode_trees, flat_columns
from system.tree import TreeValidationError

BAD = (TreeValidationError, TreeCodecError, ValueError)


def with_column(batch: pa.RecordBatch, name: str, values: np.ndarray) -> pa.RecordBatch:
    cols = [
        pa.array(values, type=batch.schema.field(name).type) if f.name == name else batch.column(f.name)
        for f in SCHEMA
    ]
    return pa.RecordBatch.from_arrays(cols, schema=SCHEMA)


def with_list_values(batch: pa.RecordBatch, name: str, values: np.ndarray) -> pa.RecordBatch:
    col = batch.column(name)
    new = pa.ListArray.from_arrays(col.offsets, pa.array(values, type=col.type.value_type))
    cols = [new if f.name == name else batch.column(f.name) for f in SCHEMA]
    return pa.RecordBatch.from_arrays(cols, schema=SCHEMA)


def outcome(fn, *args) -> str | None:
    try:
        fn(*args)
    except BAD as e:
        return type(e).__name__
    return None


def corrupt(batch: pa.RecordBatch, kind: str, row: int) -> pa.RecordBatch:
    """One value changed, of the kind named; `row` picks where (modulo the rows)."""
    n = batch.num_rows
    r = row % n
    ints = {k: batch.column(k).to_numpy().copy() for k in ("node_id", "parent", "depth", "policy_version")}
    reward = batch.column("reward").to_numpy(zero_copy_only=False).copy()
    if kind in ints:
        ints[kind][r] += (-1) ** row * (1 + row % 3)
        return with_column(batch, kind, ints[kind])
    if kind == "reward_nan":
        reward[r] = np.nan
        return with_column(batch, "reward", reward)
    if kind == "reward_set":
        reward[r] = 0.5
        return with_column(batch, "reward", reward)
    values = batch.column(kind).values.to_numpy(zero_copy_only=False).copy()
    if values.size == 0:
        return batch
    i = row % values.size
    values[i] = {"tokens": -3, "behavior_logprobs": 0.5, "loss_mask": 1 - values[i]}[kind]
    return with_list_values(batch, kind, values)


KINDS = [
    "node_id",
    "parent",
    "depth",
    "policy_version",
    "reward_nan",
    "reward_set",
    "tokens",
    "behavior_logprobs",
    "loss_mask",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=4), st.sampled_from(KINDS), st.integers(0, 999))
def test_columns_and_objects_agree_on_any_single_corruption(seeds, kind, row):
    trees = [make_tree(s) for s in dict.fromkeys(seeds)]
    batch = corrupt(encode_trees(trees), kind, row)
    by_columns = outcome(lambda b: check_trees(b, flat_columns(b)), batch)
    by_objects = outcome(decode_trees, batch)
    assert by_columns == by_objects, (kind, row)


def test_valid_trees_pass_and_a_bad_one_is_named_in_validate_trees_words():
    batch = encode_trees([make_tree(i) for i in range(20)] + [credited(make_tree(99))])
    check_trees(batch, flat_columns(batch))  # no error
    reward = batch.column("reward").to_numpy(zero_copy_only=False).copy()
    tree = make_tree(0)
    leaf = int(tree.leaves[0])  # tree t0's first leaf (rows of t0 come first, in node-id order)
    reward[leaf] = np.nan
    bad = with_column(batch, "reward", reward)
    with pytest.raises(TreeValidationError, match=rf"tree 't0' node {leaf}: leaf without a finite reward"):
        check_trees(bad, flat_columns(bad))
