"""Fuzzed weight messages (system/weight_codec.py, system/weight_wire.py, actors/weight_subscriber.py): any
flipped, truncated, extended, dropped or swapped part of a message is rejected with a WeightMessageError
naming the part, and a subscriber that received it keeps its last good version, then applies the next
good one exactly.

2,000 derandomized cases against the codec, 2,000 against a real WeightSubscriber whose DEALER socket is
swapped for an in-process double that answers like the publisher (no network, no timing): over the socket
path (chunks) and the same-host path (the payload in a file the locator names, as a memfd would be).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import deque

import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from actors.weight_subscriber import WeightSubscriber
from system.weight_codec import WeightAssembler, WeightMessageError, encode_weights
from system.weight_wire import ANNOUNCE, GET, GONE, LATEST, META, NONE

CHUNK = 64


def tensors(version: int) -> dict[str, np.ndarray]:
    """~160 bytes over 3 chunks of 64: two tensors, one padding gap (64-byte alignment)."""
    return {
        "w": np.arange(20, dtype=np.float32) * version,  # bytes [0, 80), padding to 128
        "b": np.full(4, version, np.int64),  # bytes [128, 160)
    }


def message(version: int) -> tuple[bytes, list[bytes]]:
    header, chunks = encode_weights(tensors(version), version, CHUNK)
    return header, [bytes(c) for c in chunks]


def assert_tensors(got: dict, version: int) -> None:
    want = tensors(version)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)


@st.composite
def damage(draw, n_chunks: int = 3):
    """(part, how, edit): part -1 is the header, else a chunk index; edit(bytes) -> bytes or None (gone)."""
    part = draw(st.integers(-1, n_chunks - 1))
    how = draw(
        st.sampled_from(
            ["flip", "truncate", "extend", "drop", "swap"] if part >= 0 else ["flip", "truncate", "extend"]
        )
    )
    flips = draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4))
    cut, extra = draw(st.integers(0, 10**6)), draw(st.binary(min_size=1, max_size=8))
    # another chunk than `part` (drawn without a filter: a rejected draw is a wasted case)
    other = draw(st.integers(0, n_chunks - 2).map(lambda k: k + (k >= part)) if part >= 0 else st.just(0))

    def edit(data: bytes, chunks: list[bytes]) -> bytes | None:
        if how == "flip":
            out, where = bytearray(data), {at % len(data): xor for at, xor in flips}  # distinct bytes
            for at, xor in where.items():
                out[at] ^= xor
            return bytes(out)
        if how == "truncate":
            return data[: cut % len(data)]
        if how == "extend":
            return data + extra
        if how == "drop":
            return None
        return chunks[other]  # another chunk's bytes in this one's place: right length or not, wrong crc

    return part, how, edit


def damaged(version: int, part: int, edit) -> tuple[bytes, list[bytes | None]]:
    header, chunks = message(version)
    if part < 0:
        return edit(header, chunks), list(chunks)
    return header, [edit(c, chunks) if k == part else c for k, c in enumerate(chunks)]


@settings(max_examples=2000, deadline=None)
@given(damage(), st.booleans())
def test_any_damaged_part_is_a_weight_message_error_naming_it(case, in_place):
    part, how, edit = case
    header, chunks = damaged(2, part, edit)
    try:
        asm = WeightAssembler(header)
        if in_place:  # the same-host path: the payload verified where it lies
            payload = b"".join(c for c in chunks if c is not None)
            WeightAssembler(header, payload).verify_buffer()
        for k, c in enumerate(chunks):
            if c is not None:
                asm.add_chunk(c, k)
        asm.finish()
    except WeightMessageError as e:
        text = str(e)
    else:
        raise AssertionError(f"damage {how} of part {part} went through")
    if part < 0:
        assert "header" in text or "magic" in text, text
    elif in_place and how != "flip":  # the length may have changed: the bytes after the damage moved
        shifted = [f"chunk {k} " for k in range(part, 3)]
        assert "payload truncated" in text or any(s in text for s in shifted), text
    else:
        assert f"chunk {part} " in text or f"chunks [{part}]" in text, text


class Frame:
    def __init__(self, data: bytes) -> None:
        self.bytes, self.buffer = data, memoryview(data)


class PublisherDouble:
    """A DEALER socket for WeightSubscriber whose far side is this publisher: answers at once (no peer, no
    timing); `offer` holds (header, chunks, locator) and is announced unasked, like a publish."""

    def __init__(self) -> None:
        self.inbox: deque[list[bytes]] = deque()
        self.offer: tuple[bytes, list[bytes | None], dict] | None = None
        self.served: dict[int, list[bytes | None]] = {}  # version -> the chunks GET answers with

    def publish(self, header: bytes, chunks: list[bytes | None], locator: dict, version: int) -> None:
        self.offer, self.served[version] = (header, chunks, {**locator, "publisher": "double"}), chunks
        self._announce()

    def _announce(self) -> None:
        header, _, locator = self.offer
        self.inbox.append([ANNOUNCE, header, json.dumps(locator).encode()])

    # ---- the socket ------------------------------------------------------------------------------------
    def send(self, frame: bytes, flags: int = 0) -> None:
        self.send_multipart([frame])

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        kind = frames[0]
        if kind == LATEST:
            self.inbox.append([NONE]) if self.offer is None else self._announce()
        elif kind == GET:
            version, index, _ = META.unpack(frames[1])
            chunks = self.served.get(version, [])
            if index >= len(chunks):
                self.inbox.append([GONE, frames[1]])
            elif chunks[index] is not None:  # a dropped chunk is never answered
                self.inbox.append([b"CHUNK", frames[1], chunks[index]])

    def poll(self, timeout: int = 0) -> int:
        return len(self.inbox)  # nothing queued = nothing arrived in time: no real wait

    def recv_multipart(self, copy: bool = True) -> list:
        frames = self.inbox.popleft()
        return frames if copy else [Frame(f) for f in frames]

    def close(self, linger: int = 0) -> None:
        pass


def subscriber(transport: str) -> tuple[WeightSubscriber, PublisherDouble]:
    sub = WeightSubscriber("inproc://treeopsd-fuzz-none", transport=transport, threads=1)
    sub._sock.close(linger=0)
    sub._sock = double = PublisherDouble()
    return sub, double


def payload_locator(chunks: list[bytes | None], folder: str) -> tuple[dict, int]:
    """The locator of a same-host payload: a file this process holds open, named by /proc/self/fd/N."""
    fd, path = tempfile.mkstemp(dir=folder)
    os.write(fd, b"".join(c for c in chunks if c is not None))
    os.unlink(path)
    st_ = os.fstat(fd)
    return {"proc": f"/proc/{os.getpid()}/fd/{fd}", "dev": st_.st_dev, "ino": st_.st_ino, "sealed": False}, fd


def publish(double: PublisherDouble, version: int, message: tuple, shm: bool) -> int | None:
    """`message` = (header, chunks) offered as `version` (the chunks GET serves for it)."""
    header, chunks = message
    folder = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    locator, fd = payload_locator(chunks, folder) if shm else ({"proc": ""}, None)
    double.publish(header, chunks, locator, version)
    return fd


@settings(max_examples=2000, deadline=None)
@given(damage(), st.sampled_from(["tcp", "shm"]))
def test_a_subscriber_rejects_a_damaged_version_and_keeps_the_last_good_one(case, path):
    part, _, edit = case
    shm = path == "shm"
    sub, double = subscriber("auto" if shm else "tcp")
    fds = []
    try:
        fds.append(publish(double, 1, message(1), shm))
        got = sub.poll(0)
        assert got is not None and got[0] == 1
        assert_tensors(got[1], 1)
        fds.append(publish(double, 2, damaged(2, part, edit), shm))
        assert sub.poll(0) is None  # rejected: nothing newer is returned ...
        stats = sub.stats()
        assert stats["version"] == 1 and stats["rejected"] >= 1, stats  # ... and v1 stays in force
        assert stats["last_error"], stats
        fds.append(publish(double, 3, message(3), shm))
        got = sub.poll(0)
        assert got is not None and got[0] == 3  # the next good version is applied, exactly
        assert_tensors(got[1], 3)
        assert sub.stats()["transport"] == ("shm" if shm else "tcp")
    finally:
        sub.close()
        for fd in fds:
            if fd is not None:
                os.close(fd)


def frame_lists() -> st.SearchStrategy[list[list[bytes]]]:
    """What may arrive from a publisher of another release, a buggy one, or a stale fetch: announcements of
    good, damaged or checksum-less headers (versions 0-5) with any locator, chunk replies with any META, any
    kind, any number of frames."""
    headers = st.one_of(
        st.integers(0, 5).map(lambda v: message(v)[0]),
        st.integers(0, 5).map(lambda v: encode_weights(tensors(v), v, CHUNK, checksums=False)[0]),
        st.binary(max_size=40),
    )
    json_value = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=6) | st.sampled_from(["double", ""]),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(LOCATOR_KEYS), inner),
        max_leaves=6,
    )
    locators = st.one_of(
        json_value.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=16),
        st.just(b"[" * 3000),  # nested past the parser's recursion limit (1000)
    )
    metas = st.one_of(
        st.tuples(st.integers(0, 5), st.integers(0, 4), st.integers(0, 3)).map(lambda m: META.pack(*m)),
        st.binary(max_size=20),
    )
    announce = st.tuples(st.just(ANNOUNCE), headers, locators).map(list)
    reply = st.tuples(st.sampled_from([b"CHUNK", GONE]), metas, st.binary(max_size=80)).map(list)
    other = st.lists(
        st.one_of(st.sampled_from([ANNOUNCE, NONE, b"CHUNK", GONE, GET, b""]), st.binary()), max_size=4
    )
    return st.lists(st.one_of(announce, reply, other), max_size=6)


LOCATOR_KEYS = ["proc", "dev", "ino", "bytes", "sealed", "publisher", "x"]


@settings(max_examples=2000, deadline=None)
@given(frame_lists())
def test_any_frames_from_the_publisher_side_never_break_a_subscriber(frames):
    sub, double = subscriber("tcp")
    try:
        publish(double, 1, message(1), shm=False)
        got = sub.poll(0)
        assert got is not None and got[0] == 1
        double.served.update({v: message(v)[1] for v in range(6)})  # a good announcement can be fetched
        double.inbox.extend(frames)
        got = sub.poll(0)  # never raises: a bad message is counted, a bad version rejected
        event("a version applied" if got is not None else "none applied")  # both are reached
        if got is not None:  # only a whole, verified version (a good header of 0-5, announced above)
            assert_tensors(got[1], got[0])
        assert sub.stats()["version"] == (1 if got is None else got[0])
        publish(double, 10, message(10), shm=False)
        got = sub.poll(0)
        assert got is not None and got[0] == 10  # and the next good version is applied, exactly
        assert_tensors(got[1], 10)
    finally:
        sub.close()
