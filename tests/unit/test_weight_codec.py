"""The weight codec: round trips, the exact header, zero-copy chunks, and every way a message breaks."""

import json
import re
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from system import weight_wire
from system.weight_codec import (
    MAGIC,
    TensorSpec,
    WeightAssembler,
    WeightHeader,
    WeightMessageError,
    add_checksums,
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
    # 32-byte chunks: [0, 32) holds a + 20 zero bytes, [32, 64) is padding, [64, 80) holds b. Format 2: one
    # crc32 per chunk (they cover every byte), none per tensor.
    payload = named["a"].tobytes() + bytes(52) + named["b"].tobytes()
    assert doc == {
        "magic": "TOPSDW1",
        "format": 2,
        "version": 5,
        "checksum": "crc32",
        "align": 64,
        "total_bytes": 80,
        "chunk_size": 32,
        "num_chunks": 3,
        "chunk_crc32": [zlib.crc32(payload[0:32]), zlib.crc32(payload[32:64]), zlib.crc32(payload[64:80])],
        "tensors": [
            {"name": "a", "dtype": "float32", "shape": [3], "offset": 0, "nbytes": 12},
            {"name": "b", "dtype": "int64", "shape": [2], "offset": 64, "nbytes": 16},
        ],
    }
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


def test_sink_padding_is_zeroed_and_a_thread_pool_changes_nothing():
    named = {"a": np.ones(3, np.float32), "b": np.arange(40, dtype=np.int16), "c": np.int8(-1)}
    serial, chunks = encode_weights(named, 2, chunk_bytes=48)
    dirty = bytearray(b"\xaa" * 300)  # a reused buffer: the padding must still come out zero
    with ThreadPoolExecutor(3) as pool:
        pooled, _ = encode_weights(named, 2, 48, sink=lambda n: dirty, map_fn=pool.map)
        bare, _ = encode_weights(named, 2, 48, map_fn=pool.map, checksums=False)
        assert add_checksums(bare, dirty, map_fn=pool.map).to_bytes() == serial
        asm = WeightAssembler(serial, dirty)
        asm.verify_buffer(pool.map)
    # a [0, 12), b [64, 144), c [192, 193): padding [12, 64) and [144, 192) zeroed; past byte 193 untouched
    assert pooled == serial and bytes(dirty[:193]) == b"".join(bytes(c) for c in chunks)
    assert dirty[12:64] == bytes(52) and dirty[144:192] == bytes(48) and dirty[193:] == b"\xaa" * 107
    assert asm.finish()["b"].tolist() == list(range(40))


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


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=5), st.integers(1, 150), st.data())
def test_any_flipped_payload_byte_names_its_chunk_in_place(sizes, chunk, data):
    """Chunks cover every byte, padding included: a flip anywhere in a buffer verified in place (the
    shared-memory path, over a thread pool) is caught, and the error names the chunk holding that byte."""
    named = {f"t{i}": np.full(n, i + 1, np.uint8) for i, n in enumerate(sizes)}
    header, chunks = encode_weights(named, 3, chunk_bytes=chunk)
    payload = bytearray(b"".join(bytes(c) for c in chunks))
    if not payload:
        return
    at = data.draw(st.integers(0, len(payload) - 1))
    payload[at] ^= 0x40
    k = at // chunk
    lo, hi = k * chunk, min((k + 1) * chunk, len(payload))
    with ThreadPoolExecutor(2) as pool, pytest.raises(WeightMessageError) as err:
        WeightAssembler(header, payload).verify_buffer(pool.map)
    assert f"v3: chunk {k} ({lo}, {hi}) checksum mismatch" in str(err.value)


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
    spec = TensorSpec("w", "float32", (1,), 0, 4)
    twice = WeightHeader(1, (spec, TensorSpec("w", "float32", (1,), 64, 4)), 68, 68, (0,))
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


def test_a_format_1_header_is_rejected_clearly():
    _, header, chunks = small_message()
    doc = header_json(header)
    doc["format"] = 1  # the old layout: a crc32 per tensor as well
    for t in doc["tensors"]:
        t["crc32"] = 0
    with pytest.raises(
        WeightMessageError, match="header format 1 is not supported: this reader takes format 2"
    ):
        WeightAssembler(with_json(header, doc))
    doc["format"] = 3
    with pytest.raises(WeightMessageError, match="header format 3 is not supported"):
        WeightHeader.from_bytes(with_json(header, doc))
    assert decode(header, chunks)["b"].tolist() == [7, -1]  # format 2 itself is fine


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
    assert {k: v for k, v in doc.items() if k not in ("checksum", "chunk_crc32")} == {
        k: v for k, v in header_json(full).items() if k not in ("checksum", "chunk_crc32")
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
    doc = header_json(full)
    doc["chunk_crc32"] = []  # "crc32" with no chunk checksums: a stripped header, not a checksum-less one
    with pytest.raises(WeightMessageError, match="num_chunks/chunk_crc32 disagree"):
        WeightHeader.from_bytes(with_json(full, doc))
    doc = header_json(bare)
    doc["checksum"] = "md5"
    with pytest.raises(WeightMessageError, match="unsupported checksum 'md5'"):
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


# ---- the wire format is defined once ----------------------------------------------------------------------
def test_the_wire_format_is_defined_once():
    """Magic, frame kinds and structs live in system/weight_wire.py; nothing else spells them out."""
    root = Path(__file__).resolve().parents[2]
    kinds = re.compile(r'b"(LATEST|ANNOUNCE|NONE|GET|CHUNK|GONE|NEED|BYE)"')
    users = ("system/weight_codec.py", "system/weight_channel.py")
    for path in (*users, "learner/weight_publisher.py", "actors/weight_subscriber.py"):
        src = (root / path).read_text()
        assert "struct.Struct(" not in src and "TOPSDW" not in src and not kinds.search(src), path
    assert (weight_wire.HEADER_PREFIX.size, weight_wire.META.size, weight_wire.VERSION.size) == (16, 16, 8)
    assert weight_wire.MAGIC == MAGIC == b"TOPSDW1\0" and weight_wire.FORMAT == 2
