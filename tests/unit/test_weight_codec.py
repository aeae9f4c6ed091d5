"""The weight codec: round trips, the exact header, zero-copy chunks, and every way a message breaks."""

import json
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from system.weight_codec import (
    MAGIC,
    TensorSpec,
    WeightAssembler,
    WeightHeader,
    WeightMessageError,
    add_checksums,
    crc32_combine,
    encode_weights,
)


def decode(header, chunks, **kw):
    asm = WeightAssembler(header)
    for c in chunks:
        asm.add_chunk(c)
    return asm.finish(**kw)


def header_json(header: bytes) -> dict:
    return json.loads(header[16:])


def with_json(header: bytes, doc: dict) -> bytes:
    """Re-seal an edited header with a correct length and checksum, so only the edit is wrong."""
    body = json.dumps(doc).encode()
    return struct.pack("<8sII", MAGIC, len(body), zlib.crc32(body)) + body


def small_message(chunk_bytes=32):
    named = {"a": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([7, -1], np.int64)}
    return named, *encode_weights(named, version=5, chunk_bytes=chunk_bytes)


# ---- crc32_combine ----------------------------------------------------------------------------------------
def test_crc32_combine_equals_crc_of_the_concatenation():
    # crc32(b"hello world") == 0x0D4A1185; from the halves "hello " and "world" without rereading bytes.
    assert crc32_combine(zlib.crc32(b"hello "), zlib.crc32(b"world"), 5) == zlib.crc32(b"hello world")
    assert zlib.crc32(b"hello world") == 0x0D4A1185
    assert crc32_combine(0, zlib.crc32(b"xyz"), 3) == zlib.crc32(b"xyz")  # crc of nothing is 0
    assert crc32_combine(zlib.crc32(b"xyz"), 0, 0) == zlib.crc32(b"xyz")


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_crc32_combine_property(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


# ---- round trips ------------------------------------------------------------------------------------------
def test_round_trip_of_every_kind_across_chunk_boundaries():
    rng = np.random.default_rng(0)
    named = {
        "f32": rng.standard_normal((37, 11)).astype(np.float32),  # 1628 bytes: spans many 100-byte chunks
        "bf16": torch.randn(9, 7, dtype=torch.bfloat16),
        "i64": np.arange(-20, 20, dtype=np.int64),
        "scalar": np.float64(2.5),  # 0-d
        "empty": np.zeros((0, 4), np.float32),
        "mask": np.array([True, False, True]),
        "f16_torch": torch.linspace(-1, 1, 13, dtype=torch.float16),
        "grad": torch.ones(3, requires_grad=True),
        "strided": np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2],  # not contiguous: copied, same values
        "big_endian": np.arange(5, dtype=">i4"),  # sent little-endian
    }
    header, chunks = encode_weights(named, version=3, chunk_bytes=100)
    assert len(chunks) > 20
    out = decode(header, chunks, bfloat16="torch")
    assert list(out) == list(named)
    np.testing.assert_array_equal(out["f32"], named["f32"])
    assert out["bf16"].dtype == torch.bfloat16 and torch.equal(out["bf16"], named["bf16"])
    np.testing.assert_array_equal(out["i64"], named["i64"])
    assert out["scalar"].shape == () and out["scalar"] == 2.5
    assert out["empty"].shape == (0, 4) and out["empty"].dtype == np.float32
    assert out["mask"].dtype == np.bool_ and out["mask"].tolist() == [True, False, True]
    np.testing.assert_array_equal(out["f16_torch"], named["f16_torch"].numpy())
    np.testing.assert_array_equal(out["strided"], named["strided"])
    assert out["big_endian"].dtype == np.dtype("<i4") and out["big_endian"].tolist() == [0, 1, 2, 3, 4]
    assert out["f32"].ctypes.data % 64 == 0  # aligned views


def test_bfloat16_raw_bits_without_torch():
    t = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    out = decode(*encode_weights({"w": t}, 1, 4 << 20))  # default bfloat16="uint16"
    # bf16 is the top half of float32: 1.0 = 0x3F80, -2.0 = 0xC000, 0.5 = 0x3F00
    assert out["w"].dtype == np.uint16 and out["w"].tolist() == [0x3F80, 0xC000, 0x3F00]
    assert json.loads(encode_weights({"w": t}, 1)[0][16:])["tensors"][0]["dtype"] == "bfloat16"


def test_exact_header_fields():
    named, header, chunks = small_message(chunk_bytes=32)
    magic, n, crc = struct.unpack_from("<8sII", header)
    body = header[16:]
    assert magic == b"TOPSDW1\0" and n == len(body) and crc == zlib.crc32(body)
    doc = json.loads(body)
    # a: 3 float32 = 12 bytes at 0; b: 2 int64 = 16 bytes at the next 64-byte boundary; total 64 + 16 = 80;
    # 32-byte chunks: [0, 32) holds a + 20 zero bytes, [32, 64) is padding, [64, 80) holds b.
    payload = named["a"].tobytes() + bytes(52) + named["b"].tobytes()
    assert doc == {
        "magic": "TOPSDW1", "format": 1, "version": 5, "checksum": "crc32", "align": 64,
        "total_bytes": 80, "chunk_size": 32, "num_chunks": 3,
        "chunk_crc32": [zlib.crc32(payload[0:32]), zlib.crc32(payload[32:64]), zlib.crc32(payload[64:80])],
        "tensors": [
            {"name": "a", "dtype": "float32", "shape": [3], "offset": 0, "nbytes": 12,
             "crc32": zlib.crc32(named["a"].tobytes())},
            {"name": "b", "dtype": "int64", "shape": [2], "offset": 64, "nbytes": 16,
             "crc32": zlib.crc32(named["b"].tobytes())},
        ],
    }  # fmt: skip
    assert b"".join(bytes(c) for c in chunks) == payload


def test_chunks_inside_one_tensor_are_views_of_the_source():
    w = np.arange(1000, dtype=np.float32)  # 4000 bytes
    _, chunks = encode_weights({"w": w, "b": np.ones(3, np.float32)}, 1, chunk_bytes=1024)
    assert np.shares_memory(np.frombuffer(chunks[0], np.uint8), w)  # zero-copy
    assert not np.shares_memory(np.frombuffer(chunks[-1], np.uint8), w)  # straddles w and b: a copy


def test_sink_receives_the_payload_in_one_pass():
    w = np.arange(100, dtype=np.int32)
    buf = bytearray()
    header, _ = encode_weights({"w": w}, 1, 128, sink=lambda n: buf.extend(bytes(n)) or buf)
    assert bytes(buf) == w.tobytes()
    asm = WeightAssembler(header, buf)  # in place: the shared-memory path
    asm.verify_buffer()
    np.testing.assert_array_equal(asm.finish()["w"], w)


def test_encode_rejects_bad_input():
    with pytest.raises(TypeError, match="complex64"):
        encode_weights({"c": np.zeros(2, np.complex64)}, 1)
    with pytest.raises(ValueError, match="no tensors"):
        encode_weights({}, 1)
    with pytest.raises(WeightMessageError, match="duplicate"):
        encode_weights({1: np.zeros(1), "1": np.zeros(1)}, 1)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=6), st.integers(1, 200), st.data())
def test_any_layout_round_trips_and_any_flipped_byte_is_caught(sizes, chunk, data):
    rng = np.random.default_rng(len(sizes) * 1000 + chunk)
    named = {f"t{i}": rng.integers(0, 255, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    header, chunks = encode_weights(named, 1, chunk_bytes=chunk)
    out = decode(header, chunks)
    assert all(np.array_equal(out[k], v) for k, v in named.items())
    if chunks:
        k = data.draw(st.integers(0, len(chunks) - 1))
        bad = bytearray(chunks[k])
        bad[data.draw(st.integers(0, len(bad) - 1))] ^= 0x01
        with pytest.raises(WeightMessageError, match=f"chunk {k} .*checksum mismatch"):
            decode(header, [*chunks[:k], bad, *chunks[k + 1 :]])


# ---- every corruption -------------------------------------------------------------------------------------
def test_flipped_byte_in_a_chunk():
    _, header, chunks = small_message()
    bad = bytearray(chunks[2])
    bad[3] ^= 0x80
    with pytest.raises(WeightMessageError, match=r"v5: chunk 2 \(64, 80\) checksum mismatch"):
        decode(header, [chunks[0], chunks[1], bad])


def test_truncated_chunk():
    _, header, chunks = small_message()
    with pytest.raises(WeightMessageError, match="chunk 2 has 15 bytes, expected 16"):
        decode(header, [chunks[0], chunks[1], bytes(chunks[2])[:-1]])


def test_missing_chunk():
    _, header, chunks = small_message()
    asm = WeightAssembler(header)
    asm.add_chunk(chunks[0], 0)
    asm.add_chunk(chunks[2], 2)
    assert asm.missing == [1] and not asm.complete
    with pytest.raises(WeightMessageError, match=r"incomplete, missing chunks \[1\] of 3"):
        asm.finish()


def test_duplicate_and_out_of_range_chunks():
    _, header, chunks = small_message()
    asm = WeightAssembler(header)
    asm.add_chunk(chunks[0])
    with pytest.raises(WeightMessageError, match="chunk 0 received twice"):
        asm.add_chunk(chunks[0], 0)
    with pytest.raises(WeightMessageError, match=r"chunk index 3 outside \[0, 3\)"):
        asm.add_chunk(chunks[0], 3)


def test_wrong_header_checksum():
    _, header, _ = small_message()
    bad = bytearray(header)
    bad[20] ^= 0x01  # inside the JSON
    with pytest.raises(WeightMessageError, match="header checksum mismatch"):
        WeightAssembler(bytes(bad))


def test_wrong_magic():
    _, header, _ = small_message()
    with pytest.raises(WeightMessageError, match="bad magic b'TOPSDW2"):
        WeightHeader.from_bytes(b"TOPSDW2\0" + header[8:])
    doc = header_json(header)
    doc["magic"] = "NOPE"
    with pytest.raises(WeightMessageError, match="'magic' is not 'TOPSDW1'"):
        WeightHeader.from_bytes(with_json(header, doc))


def test_truncated_header():
    _, header, _ = small_message()
    with pytest.raises(WeightMessageError, match=r"header JSON is .* bytes, its prefix says"):
        WeightHeader.from_bytes(header[:-5])
    with pytest.raises(WeightMessageError, match="header truncated"):
        WeightHeader.from_bytes(header[:10])


def test_duplicate_names():
    spec = TensorSpec("w", "float32", (1,), 0, 4, zlib.crc32(bytes(4)))
    twice = WeightHeader(1, (spec, TensorSpec("w", "float32", (1,), 64, 4, 0)), 68, 68, (0,))
    with pytest.raises(WeightMessageError, match="duplicate or empty tensor name 'w'"):
        WeightHeader.from_bytes(twice.to_bytes())


def test_inconsistent_header_fields_are_named():
    _, header, _ = small_message()
    doc = header_json(header)
    doc["tensors"][1]["nbytes"] = 24
    with pytest.raises(WeightMessageError, match="tensor 'b': nbytes 24"):
        WeightHeader.from_bytes(with_json(header, doc))
    doc = header_json(header)
    doc["tensors"][1]["offset"] = 8  # overlaps a
    with pytest.raises(WeightMessageError, match=r"tensor 'b'.*overlaps"):
        WeightHeader.from_bytes(with_json(header, doc))
    doc = header_json(header)
    doc["num_chunks"] = 4
    with pytest.raises(WeightMessageError, match="num_chunks"):
        WeightHeader.from_bytes(with_json(header, doc))
    doc = header_json(header)
    doc["tensors"][0]["dtype"] = "float128"
    with pytest.raises(WeightMessageError, match="tensor 'a': unknown dtype 'float128'"):
        WeightHeader.from_bytes(with_json(header, doc))
    doc = header_json(header)
    doc["version"] = "5"
    with pytest.raises(WeightMessageError, match="field 'version' missing or not int"):
        WeightHeader.from_bytes(with_json(header, doc))


def test_tensor_checksum_mismatch_with_good_chunks():
    _, header, chunks = small_message()
    doc = header_json(header)
    doc["tensors"][0]["crc32"] ^= 1  # chunk checksums still match the bytes; the tensor's does not
    with pytest.raises(WeightMessageError, match="tensor 'a' checksum mismatch"):
        decode(with_json(header, doc), chunks)


def test_in_place_buffer_corruption_and_truncation():
    _, header, chunks = small_message()
    payload = bytearray(b"".join(bytes(c) for c in chunks))
    payload[70] ^= 0xFF
    with pytest.raises(WeightMessageError, match=r"chunk 2 .*checksum mismatch"):
        WeightAssembler(header, payload).verify_buffer()
    with pytest.raises(WeightMessageError, match="payload truncated: 79 of 80 bytes"):
        WeightAssembler(header, payload[:79])


# ---- headers without checksums (a sealed payload announced before it is hashed) ----------------------------
def test_header_without_checksums_round_trips_and_add_checksums_completes_it():
    named = {"a": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([7, -1], np.int64)}
    full, chunks = encode_weights(named, version=5, chunk_bytes=32)
    payload = bytearray()
    bare, _ = encode_weights(
        named, 5, 32, sink=lambda n: payload.extend(bytes(n)) or payload, checksums=False
    )
    doc = header_json(bare)
    assert doc["checksum"] == "none" and doc["chunk_crc32"] == [] and doc["num_chunks"] == 3
    assert [t["crc32"] for t in doc["tensors"]] == [0, 0]
    assert {k: v for k, v in doc.items() if k not in ("checksum", "chunk_crc32", "tensors")} == {
        k: v for k, v in header_json(full).items() if k not in ("checksum", "chunk_crc32", "tensors")
    }  # the same layout
    h = WeightHeader.from_bytes(bare)
    assert not h.has_checksums and h.chunk_crc32 == () and h.to_bytes() == bare
    assert bytes(payload) == b"".join(bytes(c) for c in chunks)  # copied all the same
    assert add_checksums(bare, payload).to_bytes() == full  # one pass over the copy: the very same header
    assert add_checksums(h, payload, map_fn=map) == WeightHeader.from_bytes(full)
    with pytest.raises(WeightMessageError, match="payload truncated: 79 of 80 bytes"):
        add_checksums(bare, payload[:79])


def test_header_without_checksums_is_validated():
    named, full, _ = small_message()
    bare = encode_weights(named, 5, 32, checksums=False)[0]
    doc = header_json(bare)
    doc["chunk_crc32"] = [0, 0, 0]  # "none" carries none
    with pytest.raises(WeightMessageError, match="num_chunks/chunk_crc32 disagree"):
        WeightHeader.from_bytes(with_json(bare, doc))
    doc = header_json(bare)
    doc["tensors"][1]["crc32"] = 12345
    with pytest.raises(WeightMessageError, match="checksum 'none' but a tensor carries a crc32"):
        WeightHeader.from_bytes(with_json(bare, doc))
    doc = header_json(full)
    doc["chunk_crc32"] = []  # "crc32" with no chunk checksums: a stripped header, not a checksum-less one
    with pytest.raises(WeightMessageError, match="num_chunks/chunk_crc32 disagree"):
        WeightHeader.from_bytes(with_json(full, doc))
    doc = header_json(bare)
    doc["checksum"] = "md5"
    with pytest.raises(WeightMessageError, match="unsupported format 1/'md5'"):
        WeightHeader.from_bytes(with_json(bare, doc))
    broken = bytearray(bare)
    broken[30] ^= 0x01
    with pytest.raises(WeightMessageError, match="header checksum mismatch"):
        WeightHeader.from_bytes(bytes(broken))  # the header's own checksum still guards it
    with pytest.raises(WeightMessageError, match=r"header JSON is .* bytes, its prefix says"):
        WeightHeader.from_bytes(bare[:-3])


def test_assembler_verifies_nothing_against_a_header_without_checksums():
    named, _, chunks = small_message()
    bare = encode_weights(named, 5, 32, checksums=False)[0]
    with pytest.raises(WeightMessageError, match="v5: header has no checksums, chunk 0 cannot be verified"):
        WeightAssembler(bare).add_chunk(chunks[0])
    payload = bytearray(b"".join(bytes(c) for c in chunks))
    asm = WeightAssembler(bare, payload)
    with pytest.raises(WeightMessageError, match="v5: header has no checksums, the payload cannot be"):
        asm.verify_buffer()
    with pytest.raises(WeightMessageError, match="incomplete"):
        asm.finish()  # nothing was accepted
    asm.verify_buffer(trusted=True)  # a sealed memfd: the bytes are the ones written
    out = asm.finish()
    assert out["a"].tolist() == [1.0, 2.0, 3.0] and out["b"].tolist() == [7, -1]
    with pytest.raises(WeightMessageError, match="payload truncated: 79 of 80 bytes"):
        WeightAssembler(bare, payload[:79])
