"""Fuzzed weight headers past their checksum (system/weight_codec.py: WeightHeader.from_bytes,
WeightAssembler): the header JSON rewritten field by field (wrong types, negative or huge numbers, other
format versions, missing or extra keys, broken tensor specs, other JSON documents) and signed again with a
correct prefix, as a publisher of another release or a buggy one would send it. The crc32 of the prefix
proves nothing here: every field must be checked on its own. Each header is either refused with a
WeightMessageError, or accepted and then the original chunks assemble into exactly its tensors or are
refused with a WeightMessageError;
never another exception, never a payload allocated from an unchecked size.

2,000 derandomized cases for field edits, 2,000 for whole documents. Pure, no sockets: seconds.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from system.weight_codec import WeightAssembler, WeightHeader, WeightMessageError, encode_weights
from system.weight_wire import FORMAT, HEADER_PREFIX, MAGIC

TENSORS = {"w": np.arange(20, dtype=np.float32), "b": np.full(4, 7, np.int64)}  # [0, 80) and [128, 160)
HEADER, CHUNKS = encode_weights(TENSORS, 2, 64)  # 160 bytes in 3 chunks of 64
CHUNKS = [bytes(c) for c in CHUNKS]
DOC = json.loads(HEADER[HEADER_PREFIX.size :])
SPEC_KEYS = sorted(DOC["tensors"][0])  # name, dtype, shape, offset, nbytes

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2, 3, FORMAT - 1, FORMAT + 1, 63, 64, 65, 2**31, 2**32, 2**63, 2**64]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["crc32", "none", "float32", "int64", "bfloat16", "complex64", "TOPSDW1", "w", "b"]),
)
# one level of nesting is enough to hit every type check (a list where an int belongs, a dict for a list);
# deeper documents are the second test's (and st.recursive would cost more than the test itself)
json_values = st.one_of(
    json_scalars,
    st.lists(json_scalars, max_size=4),
    st.dictionaries(st.sampled_from([*SPEC_KEYS, "x"]), json_scalars, max_size=3),
)


def sign(body: bytes) -> bytes:
    """A header whose prefix (magic, length, crc32) is right for `body`: only the JSON can be wrong."""
    return HEADER_PREFIX.pack(MAGIC, len(body), zlib.crc32(body)) + body


@st.composite
def edited_docs(draw) -> dict:
    """The good header's JSON with 1-3 edits: a top-level field or a tensor spec's field set to another
    value or removed, a key added, a tensor dropped or duplicated."""
    doc = json.loads(json.dumps(DOC))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top", "spec", "tensors"]))
        if where == "top":
            key = draw(st.sampled_from([*sorted(DOC), "extra"]))
            doc.pop(key, None) if draw(st.booleans()) else doc.__setitem__(key, draw(json_values))
        elif where == "spec" and isinstance(doc.get("tensors"), list) and doc["tensors"]:
            spec = doc["tensors"][draw(st.integers(0, len(doc["tensors"]) - 1))]
            if isinstance(spec, dict):
                key = draw(st.sampled_from([*SPEC_KEYS, "extra"]))
                spec.pop(key, None) if draw(st.booleans()) else spec.__setitem__(key, draw(json_values))
        elif isinstance(doc.get("tensors"), list) and doc["tensors"]:
            specs = doc["tensors"]
            doc["tensors"] = draw(st.sampled_from([specs[:1], specs[1:], specs + specs[:1], specs[::-1], []]))
    return doc


def assemble(header: bytes) -> dict | None:
    """The tensors the original chunks assemble into under `header`, or None when refused."""
    try:
        asm = WeightAssembler(header)
        for k, chunk in enumerate(CHUNKS):
            if k < asm.header.num_chunks:
                asm.add_chunk(chunk, k)
        return asm.finish()
    except WeightMessageError:
        return None


def assert_consistent(header: bytes, got: dict | None) -> None:
    """Accepted: each tensor is the bytes the header places, of its dtype and shape, inside the payload."""
    if got is None:
        return
    h = WeightHeader.from_bytes(header)
    payload = b"".join(CHUNKS)
    assert len(payload) == h.total_bytes and sorted(got) == sorted(t.name for t in h.tensors)
    for t in h.tensors:
        assert got[t.name].shape == t.shape and got[t.name].tobytes() == payload[t.offset : t.end]


@settings(max_examples=2000, deadline=None)
@given(edited_docs())
def test_an_edited_header_is_refused_or_assembles_exactly_what_it_says(doc):
    header = sign(json.dumps(doc).encode())
    try:
        WeightHeader.from_bytes(header)
    except WeightMessageError as e:
        assert str(e).startswith(("header", "tensor", "duplicate or empty tensor name")), e
        event("header refused")
        return
    got = assemble(header)
    event("accepted, assembled" if got is not None else "accepted, chunks refused")  # both are reached
    assert_consistent(header, got)


documents = st.one_of(
    st.recursive(json_values, lambda inner: st.lists(inner, max_size=3), max_leaves=4).map(
        lambda v: json.dumps(v).encode()
    ),
    st.binary(max_size=64),  # not UTF-8, not JSON
    st.integers(1, 5000).map(lambda n: b"[" * n),  # nested past the parser's recursion limit (1000)
    st.integers(1, 5000).map(lambda n: b'{"a":' * n),
)


@settings(max_examples=2000, deadline=None)
@given(documents)
def test_any_signed_document_is_a_header_or_a_weight_message_error(body):
    header = sign(body)
    try:
        WeightHeader.from_bytes(header)
    except WeightMessageError:
        return
    assert_consistent(header, assemble(header))


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        ({"format": 1}, r"^header format 1 is not supported: this reader takes format 2 only"),
        ({"format": 3}, r"^header format 3 is not supported"),
        ({"version": -1}, r"^header: version -1, total 160, chunk_size 64 invalid"),
        ({"version": 2**64}, r"^header: version 18446744073709551616, total 160, chunk_size 64 invalid"),
        ({"version": True}, r"^header: field 'version' missing or not int \(got True\)"),
        ({"checksum": "md5"}, r"^header: unsupported checksum 'md5'"),
        ({"num_chunks": 4}, r"^header: num_chunks/chunk_crc32 disagree with ceil\(160 / 64\)"),
        ({"chunk_crc32": [1, 2, 2**32]}, r"^header: chunk_crc32 holds a value that is not a u32"),
        ({"total_bytes": 150}, r"^tensor 'b': \[128, 160\) overlaps or passes 150"),  # still 3 chunks
    ],
)
def test_named_field_errors(edit, error):
    """The cases the fuzz suite must reach, each with the error it gives (checked by hand)."""
    with pytest.raises(WeightMessageError, match=error):
        WeightHeader.from_bytes(sign(json.dumps({**DOC, **edit}).encode()))


@pytest.mark.parametrize("total", [2**62, 2**64 + 5])
def test_a_huge_claimed_payload_is_refused_not_allocated(total):
    """A header may claim any size: one that cannot be held is a WeightMessageError, not a MemoryError.
    (2**62 bytes: 4 EiB, past any machine's address space, overcommit or not; 2**64 + 5: past what numpy
    can index.)"""
    doc = {**DOC, "checksum": "none", "chunk_crc32": [], "total_bytes": total, "chunk_size": 2**30}
    doc["num_chunks"] = -(-total // 2**30)
    header = sign(json.dumps(doc).encode())
    assert WeightHeader.from_bytes(header).total_bytes == total  # the layout alone is valid ...
    with pytest.raises(WeightMessageError, match=rf"^v2: cannot hold a payload of {total} bytes"):
        WeightAssembler(header)  # ... a buffer for it is not


def test_the_good_header_assembles_the_tensors():
    got = assemble(HEADER)
    assert got is not None and sorted(got) == ["b", "w"]
    np.testing.assert_array_equal(got["w"], TENSORS["w"])
    np.testing.assert_array_equal(got["b"], TENSORS["b"])
    assert WeightHeader.from_bytes(sign(json.dumps(DOC).encode())) == WeightHeader.from_bytes(HEADER)
