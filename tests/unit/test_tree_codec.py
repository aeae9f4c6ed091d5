"""Arrow tree codec: exact round trips (hypothesis), zero-copy views, schema-version refusal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.tree_codec import (
    SCHEMA,
    VERSION_KEY,
    SchemaVersionError,
    TreeCodecError,
    decode_ipc,
    decode_trees,
    encode_ipc,
    encode_trees,
    flat_batches,
    flat_columns,
)
from system.tree import NodeCredit, RolloutTree, TreeValidationError, make_node

ROOT = Path(__file__).resolve().parents[2]
TOKEN = st.integers(0, 2**31 - 1)
F32 = st.floats(width=32)  # NaN (several payloads), ±inf, ±0 included
LOGPROB = st.floats(max_value=0.0, width=32, allow_nan=False) | st.just(float("nan"))


def parents_for(shape: str, n: int, draw) -> list[int]:
    if shape == "chain":
        return [-1, *range(n)]
    if shape == "fan":
        return [-1] + [0] * n
    return [-1, 0] + [draw(st.integers(0, k - 1)) for k in range(2, n + 1)]


@st.composite
def node_payload(draw, node_id: int, parent: int, depth: int, leaf: bool):
    size = draw(st.integers(0, 5))
    mask = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    lp = [draw(LOGPROB) if m else draw(F32) for m in mask]  # masked log-probs: anything, NaN included
    tokens = draw(st.lists(TOKEN, min_size=size, max_size=size))
    obs = draw(st.lists(TOKEN, max_size=3))
    reward = draw(st.floats(allow_nan=False, allow_infinity=False)) if leaf else None
    version = draw(st.integers(0, 2**40))
    return make_node(node_id, parent, depth, tokens, mask, lp, obs, version, reward)


@st.composite
def rollout_trees(draw, tree_id: str = "t"):
    shape = draw(st.sampled_from(["random", "random", "chain", "fan", "one_turn"]))
    n = 1 if shape == "one_turn" else draw(st.integers(1, 50 if shape in ("chain", "fan") else 12))
    parents = parents_for(shape, n, draw)
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    inner = set(parents)
    root = make_node(0, -1, 0, obs_tokens=draw(st.lists(TOKEN, max_size=4)))
    nodes = [root] + [draw(node_payload(j, parents[j], depth[j], j not in inner)) for j in range(1, n + 1)]
    meta = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
    tree = RolloutTree.build(tree_id, nodes, prompt_id=draw(st.text(max_size=6)), meta=meta)
    if draw(st.booleans()):
        vals = st.lists(st.floats(width=64), min_size=n + 1, max_size=n + 1).map(np.array)
        tau = draw(st.none() | st.floats(0.01, 10.0))
        tree = tree.with_credit(NodeCredit(draw(vals), draw(vals), draw(vals), tau))
    return tree


def bits_equal(a: RolloutTree, b: RolloutTree) -> bool:
    """Stricter than equals(): log-probs and credit compared bit for bit (NaN payloads, -0.0)."""
    pairs = zip(a.nodes, b.nodes, strict=True)
    same = all(x.behavior_logprobs.tobytes() == y.behavior_logprobs.tobytes() for x, y in pairs)
    if a.credit is not None and b.credit is not None:
        same &= all(getattr(a.credit, c).tobytes() == getattr(b.credit, c).tobytes() for c in "zVq")
    return same


@st.composite
def forests(draw):
    k = draw(st.integers(1, 4))
    return [draw(rollout_trees(tree_id=f"tree-{i}-é")) for i in range(k)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests())
def test_round_trip_is_exact(trees):
    batch = encode_trees(trees)
    assert batch.schema.metadata[VERSION_KEY] == b"1"
    assert batch.num_rows == sum(len(t.nodes) for t in trees)
    for decoded in (
        decode_trees(batch),
        decode_ipc(encode_ipc(trees)),
        decode_trees(pa.Table.from_batches([batch])),
    ):
        assert len(decoded) == len(trees)
        for a, b in zip(trees, decoded, strict=True):
            assert a.equals(b), a.tree_id
            assert bits_equal(a, b)
            assert (a.credit is None) == (b.credit is None)
            assert a.credit is None or (a.credit.tau is None) == (b.credit.tau is None)


def chain(n: int, tree_id: str = "chain") -> RolloutTree:
    nodes = [make_node(0, -1, 0, obs_tokens=[1, 2])]
    nodes += [
        make_node(j, j - 1, j, [j], [1], [-0.5], reward=1.0 if j == n else None) for j in range(1, n + 1)
    ]
    return RolloutTree.build(tree_id, nodes)


def fan(n: int, tree_id: str = "fan") -> RolloutTree:
    nodes = [make_node(0, -1, 0)] + [make_node(j, 0, 1, [], [], [], reward=float(j)) for j in range(1, n + 1)]
    return RolloutTree.build(tree_id, nodes)


def test_deep_chain_wide_fan_and_empty_observations():
    trees = [chain(50), fan(50), chain(1, "one-turn")]
    out = decode_trees(encode_trees(trees))
    assert [t.nodes[-1].depth for t in out] == [50, 1, 1]
    assert out[1].num_leaves == 50 and all(len(n.obs_tokens) == 0 for n in out[1].nodes)
    assert all(a.equals(b) for a, b in zip(trees, out, strict=True))


def test_nan_payload_and_negative_zero_survive_bit_for_bit():
    payload = np.array([0x7FC00001, 0xFFC12345, 0x80000000], dtype=np.uint32).view(np.float32)  # 2 NaNs, -0.0
    node = make_node(1, 0, 1, [5, 6, 7], [0, 0, 1], payload, reward=0.0)
    tree = RolloutTree.build("nan", [make_node(0, -1, 0), node])
    out = decode_trees(encode_trees([tree]))[0]
    assert out.nodes[1].behavior_logprobs.view(np.uint32).tolist() == [0x7FC00001, 0xFFC12345, 0x80000000]


def test_credit_absent_and_tau_none_are_distinct():
    t = chain(2)
    c = NodeCredit(np.array([np.nan, np.nan, 0.0]), np.array([np.nan, 0.1, 0.0]), np.full(3, 0.5), None)
    a, b = decode_trees(encode_trees([t, chain(2, "b").with_credit(c)]))
    assert a.credit is None
    assert b.credit is not None and b.credit.tau is None and b.credit.equals(c)
    f = flat_columns(encode_trees([t, chain(2, "b").with_credit(c)]))
    assert f.has_credit.tolist() == [False] * 3 + [True] * 3 and not f.has_tau.any()


def test_flat_columns_are_zero_copy_views_and_match_the_trees():
    trees = [chain(3), fan(4)]
    batch = encode_trees(trees)
    f = flat_columns(batch)
    assert f.tree_ids == ["chain", "fan"] and f.tree_starts.tolist() == [0, 4, 9]
    tok = batch.column("tokens").values.buffers()[1]
    assert f.tokens.values.ctypes.data == tok.address  # a view of the Arrow buffer, not a copy
    assert not f.tokens.values.flags.writeable
    assert f.tokens.lengths.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0]
    tree = decode_trees(batch)[0]
    node = tree.nodes[2]
    assert np.shares_memory(node.tokens, f.tokens.values) or node.tokens.ctypes.data == tok.address + 4


def test_sliced_batches_decode_by_absolute_offsets():
    batch = encode_trees([chain(3), chain(5, "mid"), fan(2)])
    mid = batch.slice(4, 6)  # rows of tree "mid" only
    (tree,) = decode_trees(mid)
    assert tree.equals(chain(5, "mid"))
    table = pa.Table.from_batches([batch.slice(0, 4), batch.slice(10, 3)])
    assert [t.tree_id for t in decode_trees(table)] == ["chain", "fan"]
    assert [len(f.tree_ids) for f in flat_batches(table)] == [1, 1]


def test_unknown_or_missing_schema_version_is_refused_naming_the_source():
    batch = encode_trees([chain(2)])
    future = batch.replace_schema_metadata({VERSION_KEY: b"999"})
    with pytest.raises(SchemaVersionError, match=r"seg\.arrow: unknown treeopsd schema version '999'"):
        decode_trees(future, source="seg.arrow")
    with pytest.raises(SchemaVersionError, match="not a treeopsd tree table"):
        decode_trees(batch.replace_schema_metadata({}))
    with pytest.raises(SchemaVersionError, match="999"):
        decode_ipc(encode_ipc([chain(1)])[:0] or _ipc(future))
    renamed = pa.RecordBatch.from_arrays(
        batch.columns[:-1], schema=pa.schema(list(SCHEMA)[:-1], SCHEMA.metadata)
    )
    with pytest.raises(TreeCodecError, match="columns differ"):
        decode_trees(renamed)


def _ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def test_decode_validates_trees_and_rejects_bad_columns():
    bad = RolloutTree("bad", (make_node(0, -1, 0), make_node(1, 0, 1, [3], [1], [-0.1])))  # leaf, no reward
    with pytest.raises(
        TreeValidationError, match=r"x\.arrow: tree 'bad' node 1: leaf without a finite reward"
    ):
        decode_trees(encode_trees([bad]), source="x.arrow")
    batch = encode_trees([chain(2)])
    mask = batch.column("loss_mask")
    two = pa.ListArray.from_arrays(mask.offsets, pa.array(np.full(len(mask.values), 2, np.uint8)))
    with pytest.raises(TreeCodecError, match="loss_mask values must be 0 or 1"):
        flat_columns(batch.set_column(8, "loss_mask", two))
    split = encode_trees([chain(1, "a"), chain(1, "b")])
    interleaved = pa.Table.from_batches([split.slice(0, 1), split.slice(2, 2), split.slice(1, 1)])
    with pytest.raises(TreeCodecError, match="non-contiguous"):
        decode_trees(interleaved.combine_chunks())
    with pytest.raises(TreeCodecError, match="more than one record batch"):
        decode_trees(interleaved)


def test_codec_never_imports_pandas():
    """pa.array()/to_numpy() would import pandas (~1 s per process); the codec goes through buffers."""
    code = (
        "import sys; sys.path.insert(0, '.');"
        "from storage.tree_codec import encode_ipc, decode_ipc, flat_columns, encode_trees;"
        "from system.tree import RolloutTree, make_node;"
        "t = RolloutTree.build('a', [make_node(0, -1, 0), make_node(1, 0, 1, [1], [1], [-1.0], reward=1.0)]);"
        "assert decode_ipc(encode_ipc([t]))[0].equals(t); flat_columns(encode_trees([t]));"
        "print('pandas' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
