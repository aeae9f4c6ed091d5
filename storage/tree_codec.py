"""Arrow columnar format for rollout trees: one row per node (root included), pure encode/decode.

Schema (version 1, stored in the schema metadata under ``treeopsd.schema_version``)::

    tree_id, prompt_id      string        repeated on every row of a tree; a tree's rows are contiguous
    node_id, parent, depth  int32         parent = -1 on the root
    policy_version          int64
    reward                  float64       NaN (not null) on the root and internal turns
    tokens, obs_tokens      list<int32>
    loss_mask               list<uint8>   0/1; uint8, not bool, so it maps zero-copy (Arrow bools are bits)
    behavior_logprobs       list<float32> NaN payloads of masked tokens survive bit-exactly
    z, V, q                 float64       null = the tree has no credit yet; NaN = credit present, undefined
    tau                     float64       per-tree tau repeated on its rows; null if no credit or tau=None
    meta                    string        the tree's meta as JSON on the root row, null on the others

Reading is zero-copy where Arrow allows it: `flat_columns` hands out offsets + value arrays viewing the Arrow
buffers (mapped files included), and `decode_trees` builds `TurnNode`s whose arrays are read-only slices of
those views. A file of another schema version is refused with `SchemaVersionError`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from system.tree import NodeCredit, RolloutTree, TreeValidationError, TurnNode

SCHEMA_VERSION = "1"
VERSION_KEY = b"treeopsd.schema_version"
CREDIT_COLUMNS = ("z", "V", "q")

SCHEMA = pa.schema(
    [
        pa.field("tree_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("node_id", pa.int32(), nullable=False),
        pa.field("parent", pa.int32(), nullable=False),
        pa.field("depth", pa.int32(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("behavior_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("obs_tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("z", pa.float64()),
        pa.field("V", pa.float64()),
        pa.field("q", pa.float64()),
        pa.field("tau", pa.float64()),
        pa.field("meta", pa.string()),
    ],
    metadata={VERSION_KEY: SCHEMA_VERSION.encode()},
)

ArrowData = pa.RecordBatch | pa.Table


class TreeCodecError(ValueError):
    """Arrow data that is not a well-formed treeopsd tree table."""


class SchemaVersionError(TreeCodecError):
    """A table or file written with a schema version this build does not read."""


def _where(source: str | None) -> str:
    return f"{source}: " if source else ""


def check_schema(schema: pa.Schema, source: str | None = None) -> None:
    """Raises SchemaVersionError / TreeCodecError unless `schema` is exactly our version-1 schema."""
    meta = schema.metadata or {}
    if VERSION_KEY not in meta:
        raise SchemaVersionError(
            f"{_where(source)}not a treeopsd tree table (no {VERSION_KEY.decode()} in the schema metadata)"
        )
    version = meta[VERSION_KEY].decode(errors="replace")
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{_where(source)}unknown treeopsd schema version {version!r} "
            f"(this build reads version {SCHEMA_VERSION!r})"
        )
    got = [(f.name, str(f.type)) for f in schema]  # nullability flags may differ; nulls are checked on read
    want = [(f.name, str(f.type)) for f in SCHEMA]
    if got != want:
        diff = sorted(set(got) ^ set(want)) or "column order"
        raise TreeCodecError(f"{_where(source)}columns differ from schema version {SCHEMA_VERSION}: {diff}")


# ---- numpy <-> Arrow through buffers ---------------------------------------------------------------------
# pa.array() and Array.to_numpy() import pandas on first use (~1 s per process); building from and viewing
# buffers avoids that and makes the zero-copy explicit.
def _bitmap(valid: np.ndarray | None) -> pa.Buffer | None:
    return None if valid is None or valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))


def as_arrow(values: np.ndarray, arrow_type: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    return pa.Array.from_buffers(
        arrow_type, len(values), [_bitmap(valid), pa.py_buffer(np.ascontiguousarray(values))]
    )


def _strings(items: Sequence[str | None]) -> pa.Array:
    data = [b"" if x is None else x.encode() for x in items]
    offsets = np.zeros(len(data) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, data), np.int64, len(data)), out=offsets[1:])
    valid = np.fromiter((x is not None for x in items), bool, len(items))
    buffers = [_bitmap(valid), pa.py_buffer(offsets), pa.py_buffer(b"".join(data))]
    return pa.Array.from_buffers(pa.string(), len(items), buffers)


def _view(arr: pa.Array, dtype: type) -> np.ndarray:
    """Read-only numpy view of a primitive array's values (nulls not handled here)."""
    buf = arr.buffers()[1]
    if buf is None or len(arr) == 0:
        return np.zeros(0, dtype)
    out = np.frombuffer(buf, dtype, count=len(arr), offset=arr.offset * np.dtype(dtype).itemsize)
    out.flags.writeable = False  # a view of shared data (maybe of a file): trees are never mutated in place
    return out


def _valid(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    bits = np.unpackbits(np.frombuffer(arr.buffers()[0], np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].astype(bool)


# ---- encode ----------------------------------------------------------------------------------------
def _list_array(parts: Sequence[np.ndarray], dtype: type, arrow_type: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise TreeCodecError("more than 2^31 list elements in one batch; commit fewer trees at a time")
    values = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(
        as_arrow(offsets.astype(np.int32), pa.int32()), as_arrow(values, arrow_type)
    )


def _credit_columns(trees: Sequence[RolloutTree], n_rows: int) -> list[pa.Array]:
    cols = {name: np.full(n_rows, np.nan) for name in (*CREDIT_COLUMNS, "tau")}
    has, has_tau = np.zeros(n_rows, dtype=bool), np.zeros(n_rows, dtype=bool)
    row = 0
    for t in trees:
        n = len(t.nodes)
        if t.credit is not None:
            c = t.credit
            for name, arr in (("z", c.z), ("V", c.V), ("q", c.q)):
                cols[name][row : row + n] = np.asarray(arr, dtype=np.float64)
            has[row : row + n] = True
            if c.tau is not None:
                cols["tau"][row : row + n] = float(c.tau)
                has_tau[row : row + n] = True
        row += n
    out = [as_arrow(cols[name], pa.float64(), has) for name in CREDIT_COLUMNS]
    return [*out, as_arrow(cols["tau"], pa.float64(), has_tau)]


def encode_trees(trees: Iterable[RolloutTree]) -> pa.RecordBatch:
    """One record batch, one row per node, trees in the given order, nodes by id. Pure; no validation."""
    trees = list(trees)
    nodes = [n for t in trees for n in t.nodes]
    ints = {
        name: np.fromiter((getattr(n, name) for n in nodes), dtype=np.int64, count=len(nodes))
        for name in ("node_id", "parent", "depth", "policy_version")
    }
    root_meta = [json.dumps(t.meta, sort_keys=True) for t in trees]
    arrays = [
        _strings([t.tree_id for t in trees for _ in t.nodes]),
        _strings([t.prompt_id for t in trees for _ in t.nodes]),
        *(as_arrow(ints[k].astype(np.int32), pa.int32()) for k in ("node_id", "parent", "depth")),
        as_arrow(ints["policy_version"], pa.int64()),
        as_arrow(np.fromiter((n.reward for n in nodes), dtype=np.float64, count=len(nodes)), pa.float64()),
        _list_array([n.tokens for n in nodes], np.int32, pa.int32()),
        _list_array([n.loss_mask for n in nodes], np.uint8, pa.uint8()),
        _list_array([n.behavior_logprobs for n in nodes], np.float32, pa.float32()),
        _list_array([n.obs_tokens for n in nodes], np.int32, pa.int32()),
        *_credit_columns(trees, len(nodes)),
        _strings(
            [
                m if i == 0 else None
                for t, m in zip(trees, root_meta, strict=True)
                for i in range(len(t.nodes))
            ]
        ),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


# ---- zero-copy column access ---------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ListColumn:
    """A list column as CSR: row i holds values[offsets[i]:offsets[i+1]] (both views, no copy)."""

    offsets: np.ndarray  # int32 [rows + 1], absolute positions into `values`
    values: np.ndarray

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass(frozen=True, eq=False)
class FlatColumns:
    """One record batch as numpy views, for the learner and the backup actor (no Python objects per row).

    Trees are row ranges: tree k spans rows tree_starts[k]:tree_starts[k+1]. Credit columns are NaN where
    null; `has_credit` / `has_tau` keep the null-ness (these four columns are the only copies made).
    """

    tree_ids: list[str]
    tree_starts: np.ndarray  # int64 [trees + 1]
    node_id: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    policy_version: np.ndarray
    reward: np.ndarray
    tokens: ListColumn
    loss_mask: ListColumn  # values viewed as bool
    behavior_logprobs: ListColumn
    obs_tokens: ListColumn
    z: np.ndarray
    V: np.ndarray
    q: np.ndarray
    tau: np.ndarray
    has_credit: np.ndarray  # bool [rows]
    has_tau: np.ndarray  # bool [rows]

    @property
    def num_rows(self) -> int:
        return len(self.node_id)


_PLAIN = {"node_id": np.int32, "parent": np.int32, "depth": np.int32, "policy_version": np.int64}


def _plain(batch: pa.RecordBatch, name: str, dtype: type) -> np.ndarray:
    arr = batch.column(name)
    if arr.null_count:
        raise TreeCodecError(f"column {name!r} holds nulls")
    return _view(arr, dtype)


def _list(batch: pa.RecordBatch, name: str, dtype: type) -> ListColumn:
    arr = batch.column(name)
    if arr.null_count or arr.values.null_count:
        raise TreeCodecError(f"column {name!r} holds nulls")
    buf, n = arr.buffers()[1], len(arr) + 1
    offsets = np.zeros(1, np.int32) if buf is None else np.frombuffer(buf, np.int32, n, arr.offset * 4)
    offsets.flags.writeable = False
    values = _view(arr.values, dtype)
    if len(offsets) != len(arr) + 1 or (len(arr) and not 0 <= offsets[0] <= offsets[-1] <= len(values)):
        raise TreeCodecError(f"column {name!r} has list offsets outside its values")
    return ListColumn(offsets, values)


def _nullable(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    valid = _valid(arr)
    values = _view(arr, np.float64).copy()
    values[~valid] = np.nan
    return values, valid


def _tree_starts(batch: pa.RecordBatch) -> tuple[np.ndarray, list[str]]:
    ids = batch.column("tree_id")
    n = len(ids)
    if ids.null_count:
        raise TreeCodecError("column 'tree_id' holds nulls")
    change = pc.indices_nonzero(pc.not_equal(ids.slice(1), ids.slice(0, n - 1))) if n > 1 else None
    inner = np.zeros(0, np.int64) if change is None else _view(change, np.uint64).astype(np.int64) + 1
    starts = np.concatenate([[0], inner, [n]]).astype(np.int64) if n else np.zeros(1, np.int64)
    names = ids.take(as_arrow(starts[:-1], pa.int64())).to_pylist()
    if len(set(names)) != len(names):
        dup = sorted({t for t in names if names.count(t) > 1})
        raise TreeCodecError(f"tree ids {dup[:5]} appear in non-contiguous row runs")
    return starts, names


def flat_columns(batch: pa.RecordBatch, source: str | None = None) -> FlatColumns:
    """Numpy views of one record batch (see FlatColumns). Raises TreeCodecError on malformed data."""
    check_schema(batch.schema, source)
    try:
        mask = _list(batch, "loss_mask", np.uint8)
        if mask.values.size and int(mask.values.max()) > 1:
            raise TreeCodecError("loss_mask values must be 0 or 1")
        starts, names = _tree_starts(batch)
        credit = {k: _nullable(batch.column(k)) for k in (*CREDIT_COLUMNS, "tau")}
        return FlatColumns(
            tree_ids=names,
            tree_starts=starts,
            **{k: _plain(batch, k, dt) for k, dt in _PLAIN.items()},
            reward=_plain(batch, "reward", np.float64),
            tokens=_list(batch, "tokens", np.int32),
            loss_mask=ListColumn(mask.offsets, mask.values.view(np.bool_)),
            behavior_logprobs=_list(batch, "behavior_logprobs", np.float32),
            obs_tokens=_list(batch, "obs_tokens", np.int32),
            **{k: v for k, (v, _) in credit.items()},
            has_credit=credit["z"][1],
            has_tau=credit["tau"][1],
        )
    except TreeCodecError as e:
        raise TreeCodecError(f"{_where(source)}{e}") from e
    except (pa.ArrowException, ValueError) as e:  # bad buffers
        raise TreeCodecError(f"{_where(source)}malformed column data: {e}") from e


def _nonempty(data: ArrowData) -> list[pa.RecordBatch]:
    return [b for b in ([data] if isinstance(data, pa.RecordBatch) else data.to_batches()) if b.num_rows]


def flat_batches(data: ArrowData, source: str | None = None) -> list[FlatColumns]:
    """`flat_columns` of every record batch of a table (chunks stay separate, so nothing is copied)."""
    return [flat_columns(b, source) for b in _nonempty(data)]


# ---- decode ----------------------------------------------------------------------------------------
def _tree_from(f: FlatColumns, k: int, meta: str | None, prompt_id: str) -> RolloutTree:
    r0, r1 = int(f.tree_starts[k]), int(f.tree_starts[k + 1])
    nodes = [
        TurnNode(
            int(f.node_id[r]),
            int(f.parent[r]),
            int(f.depth[r]),
            f.tokens.row(r),
            f.loss_mask.row(r),
            f.behavior_logprobs.row(r),
            f.obs_tokens.row(r),
            int(f.policy_version[r]),
            float(f.reward[r]),
        )
        for r in range(r0, r1)
    ]
    order = np.argsort(f.node_id[r0:r1], kind="stable")  # credit arrays follow node ids, like nodes
    has = f.has_credit[r0:r1]
    if has.any() and not has.all():
        raise TreeValidationError(f"tree {f.tree_ids[k]!r}: credit present on some nodes only")
    credit = None
    if has.all():
        tau = float(f.tau[r0]) if f.has_tau[r0] else None
        credit = NodeCredit(*(getattr(f, c)[r0:r1][order] for c in CREDIT_COLUMNS), tau=tau)
    meta_dict = json.loads(meta) if meta else {}
    return RolloutTree.build(f.tree_ids[k], nodes, prompt_id, meta_dict, credit)


def decode_trees(data: ArrowData, source: str | None = None) -> list[RolloutTree]:
    """Validated trees of a batch or table, zero-copy node arrays. Errors name `source` (a file, say)."""
    out: list[RolloutTree] = []
    flats = flat_batches(data, source)
    ids = [t for f in flats for t in f.tree_ids]
    if len(set(ids)) != len(ids):  # a tree split across record batches, or one id twice
        dup = sorted({t for t in ids if ids.count(t) > 1})[:5]
        raise TreeCodecError(f"{_where(source)}tree ids {dup} appear in more than one record batch")
    for f, batch in zip(flats, _nonempty(data), strict=True):
        roots = f.tree_starts[:-1]
        metas = batch.column("meta").take(as_arrow(roots, pa.int64())).to_pylist()
        prompts = batch.column("prompt_id").take(as_arrow(roots, pa.int64())).to_pylist()
        for k in range(len(f.tree_ids)):
            try:
                out.append(_tree_from(f, k, metas[k], prompts[k]))
            except TreeValidationError as e:
                raise TreeValidationError(f"{_where(source)}{e}") from e
            except (json.JSONDecodeError, TypeError) as e:
                raise TreeCodecError(f"{_where(source)}tree {f.tree_ids[k]!r}: bad meta JSON ({e})") from e
    return out


# ---- IPC bytes: the *file* format, exactly what a store segment holds (so a commit writes what it got) ---
def table_to_ipc(data: ArrowData) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, data.schema) as writer:
        writer.write(data)
    return sink.getvalue().to_pybytes()


def ipc_to_table(buf: bytes | memoryview | pa.Buffer, source: str | None = None) -> pa.Table:
    """Reads IPC bytes (file format; the stream format too) without copying; checks the schema version."""
    data = buf if isinstance(buf, pa.Buffer) else pa.py_buffer(buf)
    is_file = data.size >= 6 and data[:6].to_pybytes() == b"ARROW1"
    reader = pa.ipc.open_file(data) if is_file else pa.ipc.open_stream(data)
    check_schema(reader.schema, source)
    return reader.read_all()


def encode_ipc(trees: Iterable[RolloutTree]) -> bytes:
    return table_to_ipc(encode_trees(trees))


def decode_ipc(buf: bytes | memoryview | pa.Buffer, source: str | None = None) -> list[RolloutTree]:
    return decode_trees(ipc_to_table(buf, source), source)
