"""Weight broadcast over real loopback sockets: versions, late joiners, corrupted messages, CURVE, binds.

The tcp path is exercised with transport="tcp"; subscribers on this host otherwise read the publisher's
shared-memory file. Corruption on the socket path comes from a raw ZeroMQ ROUTER speaking the protocol.
"""

import contextlib
import functools
import json
import os
import struct
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from actors.weight_subscriber import META, WeightSubscriber
from learner import weight_publisher
from learner.weight_publisher import InMemoryWeightChannel, WeightPublisher
from system.weight_codec import WeightHeader, encode_weights

CHUNK_MB = 1 / 64  # 16 KiB chunks: the ~40 KiB payload below spans several


def weights(step: int) -> dict:
    return {
        "embed": torch.full((64, 160), float(step)),  # 40 KiB: 3 chunks with the norm and count
        "norm": torch.arange(7, dtype=torch.bfloat16) * step,
        "count": np.int64(step),
    }


def assert_weights(got, version: int) -> None:
    assert got is not None and got[0] == version, got
    want = weights(version)
    np.testing.assert_array_equal(got[1]["embed"], want["embed"].numpy())
    assert torch.equal(got[1]["norm"], want["norm"]) and int(got[1]["count"]) == version


@pytest.fixture
def publisher():
    pub = WeightPublisher(chunk_mb=CHUNK_MB)
    yield pub
    pub.close()


@pytest.fixture
def subscriber():
    """Factory: WeightSubscriber(...) closed at teardown even when the test fails."""
    made = []
    yield lambda *a, **kw: made.append(WeightSubscriber(*a, **kw)) or made[-1]
    for sub in made:
        sub.close()


def test_one_subscriber_gets_each_version_once_and_a_snapshot(publisher, subscriber):
    sub = subscriber(publisher.endpoint)
    assert sub.poll(100) is None  # nothing published yet
    for v in (1, 2, 3):
        tensors = weights(v)
        publisher.publish(tensors, v)
        tensors["embed"] += 100  # the learner trains on in place: the published snapshot must not change
        assert_weights(sub.poll(5000), v)
        assert sub.poll(0) is None  # nothing newer: nothing applied twice
    assert sub.stats()["transport"] == "shm" and sub.stats()["rejected"] == 0
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(weights(3), 3)
    with pytest.raises(TypeError, match="complex64"):
        publisher.publish({"c": np.zeros(2, np.complex64)}, 4)
    publisher.publish(weights(4), 4)  # a failed publish announces nothing and breaks nothing
    assert_weights(sub.poll(5000), 4)


def test_three_subscribers_over_both_transports(publisher, subscriber):
    subs = [subscriber(publisher.endpoint, transport=t) for t in ("auto", "tcp", "tcp")]
    for v in (1, 2, 3):
        publisher.publish(weights(v), v)
        for sub in subs:
            assert_weights(sub.poll(5000), v)
    assert [s.stats()["transport"] for s in subs] == ["shm", "tcp", "tcp"]
    assert publisher.stats()["chunks_served"] == 2 * 3 * 3  # 2 tcp subscribers x 3 versions x 3 chunks


def test_late_joiner_and_missed_versions_get_the_latest(publisher, subscriber):
    early = subscriber(publisher.endpoint, transport="tcp")
    for v in (1, 2, 3):
        publisher.publish(weights(v), v)
    late = subscriber(publisher.endpoint, transport="tcp")
    assert_weights(late.poll(5000), 3)
    assert_weights(early.poll(5000), 3)  # missed 1 and 2: only the newest is fetched
    assert early.poll(200) is None


def test_a_restarted_publisher_is_followed_even_with_lower_versions(subscriber):
    first = WeightPublisher(chunk_mb=CHUNK_MB)
    sub = subscriber(first.endpoint, refresh_s=0.1)
    first.publish(weights(5), 5)
    assert_weights(sub.poll(5000), 5)
    port = first.port
    first.close()
    with WeightPublisher(port=port, chunk_mb=CHUNK_MB) as again:  # resumed from an older checkpoint
        again.publish(weights(3), 3)
        assert_weights(sub.poll(5000), 3)
        assert sub.poll(300) is None


def test_same_host_payload_is_sealed_and_not_rehashed(publisher, subscriber):
    sub = subscriber(publisher.endpoint)
    checked = subscriber(publisher.endpoint, verify_sealed=True)
    publisher.publish(weights(1), 1)
    path = publisher.stats()["payload_path"]  # /proc/PID/fd/N of the memfd
    with pytest.raises(PermissionError), open(path, "r+b") as f:
        f.write(b"x")  # sealed: the kernel refuses writes, to every process
    with pytest.raises(PermissionError):
        os.truncate(path, 100)
    assert_weights(sub.poll(5000), 1)
    assert_weights(checked.poll(5000), 1)
    assert (sub.stats()["transport"], sub.stats()["verified"]) == ("shm", "sealed")
    assert (checked.stats()["transport"], checked.stats()["verified"]) == ("shm", "checksums")


def test_corrupted_or_truncated_unsealed_payload_is_rejected(subscriber):
    with WeightPublisher(chunk_mb=CHUNK_MB, seal=False) as pub:
        sub = subscriber(pub.endpoint)
        pub.publish(weights(1), 1)
        assert_weights(sub.poll(5000), 1)
        pub.publish(weights(2), 2)
        with open(pub.stats()["payload_path"], "r+b") as f:  # flip one byte of the published payload
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0x01]))
        assert sub.poll(500) is None
        stats = sub.stats()
        assert stats["version"] == 1 and stats["rejected"] >= 1 and "checksum mismatch" in stats["last_error"]
        pub.publish(weights(3), 3)
        os.truncate(pub.stats()["payload_path"], 100)
        assert sub.poll(500) is None
        assert sub.stats()["version"] == 1 and "truncated" in sub.stats()["last_error"]
        pub.publish(weights(4), 4)
        assert_weights(sub.poll(5000), 4)  # recovers with the next good version
        assert sub.stats()["verified"] == "checksums"
        # Unsealed: hashed while copied and never announced without checksums.
        assert sub.stats()["unhashed"] == sub.stats()["waited_for_checksums"] == 0
        assert pub.stats()["hashing"] is False


class RawPublisher:
    """A raw ROUTER that speaks the protocol and serves whatever chunks a test sets (None: never answer)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.message = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def set(self, version: int, edit=None) -> None:
        header, chunks = encode_weights(weights(version), version, int(CHUNK_MB * 2**20))
        chunks = [bytes(c) for c in chunks]
        self.message = (header, edit(chunks) if edit else chunks)

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            peer, kind, *rest = self.sock.recv_multipart()
            if kind == b"LATEST" and not self.message:
                self.sock.send_multipart([peer, b"NONE"])
            elif kind == b"LATEST":
                self.sock.send_multipart([peer, b"ANNOUNCE", self.message[0], json.dumps({}).encode()])
            elif kind == b"GET":
                chunk = self.message[1][META.unpack(rest[0])[1]]
                if chunk is not None:
                    self.sock.send_multipart([peer, b"CHUNK", rest[0], chunk])
        self.sock.close(linger=0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.ctx.term()


def flip(k):
    return lambda chunks: [*chunks[:k], bytes([chunks[k][0] ^ 0xFF]) + chunks[k][1:], *chunks[k + 1 :]]


@pytest.fixture
def raw():
    server = RawPublisher()
    yield server
    server.close()


def test_corrupted_truncated_or_missing_chunks_over_the_socket_are_rejected(raw, subscriber):
    sub = subscriber(raw.endpoint, transport="tcp", fetch_timeout_s=0.5, refresh_s=0.2)
    raw.set(1)  # after the subscriber's first LATEST (answered NONE): found by its periodic refresh
    assert_weights(sub.poll(5000), 1)
    cases = [
        (2, flip(1), "v2: chunk 1 (16384, 32768) checksum mismatch"),
        (3, lambda c: [*c[:-1], c[-1][:-1]], "v3: chunk 2 has"),  # the last chunk one byte short
        (4, lambda c: [c[0], None, c[2]], "v4: timed out with chunks [1] of 3 missing"),
    ]
    for version, edit, error in cases:
        raw.set(version, edit)
        sub.request_latest()
        assert sub.poll(300) is None
        assert sub.version == 1 and error in sub.stats()["last_error"], sub.stats()
    assert sub.stats()["rejected"] >= 3
    raw.set(5)
    sub.request_latest()
    assert_weights(sub.poll(5000), 5)  # the last good version stayed in force until this one


def test_curve_subscriber_needs_the_server_key(subscriber):
    with WeightPublisher(auth="curve", chunk_mb=CHUNK_MB) as pub:
        pub.publish(weights(1), 1)
        good = subscriber(pub.endpoint, server_public_key=pub.public_key, transport="tcp")
        no_key = subscriber(pub.endpoint)
        wrong_key = subscriber(pub.endpoint, server_public_key=zmq.curve_keypair()[0])
        assert_weights(good.poll(5000), 1)
        assert no_key.poll(800) is None and wrong_key.poll(200) is None
        assert no_key.stats()["received"] == wrong_key.stats()["received"] == 0


def test_non_loopback_bind_needs_curve():
    for host in ("0.0.0.0", "*", "10.1.2.3", "example.org"):
        with pytest.raises(ValueError, match="without auth='curve'"):
            WeightPublisher(bind_host=host)
    with pytest.raises(ValueError, match="auth must be"):
        WeightPublisher(auth="password")
    WeightPublisher(bind_host="0.0.0.0", auth="curve").close()
    WeightPublisher(bind_host="localhost").close()


def memfds() -> set[int]:
    """Inodes of the payload memfds this process holds open (a mapping holds its own descriptor too)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # e.g. the descriptor listdir itself used
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:treeopsd"):
                inodes.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
    return inodes


def test_unknown_versions_and_bad_requests(publisher):
    publisher.publish(weights(1), 1)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.endpoint)
    dealer.send_multipart([b"GET", META.pack(99, 0, 7)])
    assert dealer.poll(5000) and dealer.recv_multipart() == [b"GONE", META.pack(99, 0, 7)]
    dealer.send(b"NONSENSE")
    dealer.send_multipart([b"NEED", b"1"])  # the version is 8 bytes
    dealer.send(b"LATEST")
    assert dealer.poll(5000) and dealer.recv_multipart()[0] == b"ANNOUNCE"
    assert publisher.stats()["bad_requests"] == 2
    for _ in range(2):  # hashed on the first request, then answered from what is known
        dealer.send_multipart([b"NEED", struct.pack(">Q", 1)])
        assert dealer.poll(5000)
        kind, header, _ = dealer.recv_multipart()
        assert kind == b"ANNOUNCE" and WeightHeader.from_bytes(header).has_checksums
    dealer.close(linger=0)
    while not publisher.stats()["spare_ready"]:  # its background allocation would skew the count
        time.sleep(0.01)
    before = memfds()
    with WeightPublisher(keep=1) as pub:
        for v in (1, 2, 3):
            pub.publish(weights(v), v)
        while not pub.stats()["spare_ready"]:  # retiring runs in the background, before the spare
            time.sleep(0.01)
        assert len(memfds() - before) <= 2  # the newest version + the pre-allocated spare
    assert memfds() <= before  # close releases every payload


def test_in_memory_twin_has_the_same_contract():
    ch = InMemoryWeightChannel(chunk_mb=CHUNK_MB)
    other = ch.sink()
    assert ch.poll() is None
    tensors = weights(1)
    ch.publish(tensors, 1)
    tensors["embed"] += 5  # snapshot taken at publish
    assert_weights(ch.poll(), 1)
    assert ch.poll() is None
    ch.publish(weights(2), 2)
    ch.publish(weights(3), 3)
    assert_weights(other.poll(), 3)  # independent reader, newest only
    assert_weights(ch.poll(timeout_ms=10), 3)
    with pytest.raises(ValueError, match="not newer"):
        ch.publish(weights(2), 2)


@pytest.fixture
def hash_gate(monkeypatch):
    """Holds every background hash (after it has taken its payload) until `gate.set()`; `entered` is set
    once a hash is waiting. The checksum-less announcement is then the only one out."""
    gate, entered = threading.Event(), threading.Event()
    real = weight_publisher.add_checksums

    def gated(*args, **kwargs):
        entered.set()
        assert gate.wait(20), "hash gate never opened"
        return real(*args, **kwargs)

    monkeypatch.setattr(weight_publisher, "add_checksums", gated)
    yield gate, entered
    gate.set()


def test_unhashed_announcement_is_used_only_over_sealed_shared_memory(publisher, subscriber, hash_gate):
    gate, entered = hash_gate
    shm = subscriber(publisher.endpoint)
    tcp = subscriber(publisher.endpoint, transport="tcp")
    checked = subscriber(publisher.endpoint, verify_sealed=True)
    publisher.publish(weights(1), 1)
    assert_weights(shm.poll(5000), 1)  # no checksum exists: the sealed memfd needs none
    stats = shm.stats()
    assert (stats["transport"], stats["verified"], stats["unhashed"]) == ("shm", "sealed", 1)
    late_shm = subscriber(publisher.endpoint)  # LATEST answers with the checksum-less announcement too
    assert_weights(late_shm.poll(5000), 1)
    assert not entered.is_set() and not publisher.stats()["hashing"]  # nobody needed checksums yet
    for sub in (tcp, checked):  # set aside, not rejected: they ask for the checksums and wait
        assert sub.poll(300) is None
        stats = sub.stats()
        assert (stats["version"], stats["rejected"], stats["received"]) == (-1, 0, 0), stats
        assert stats["waited_for_checksums"] >= 1
    assert entered.wait(5) and publisher.stats()["hashing"]  # hashing on request (held here)
    assert publisher.stats()["chunks_served"] == 0
    gate.set()  # the same version, announced again with checksums
    assert_weights(tcp.poll(5000), 1)
    assert_weights(checked.poll(5000), 1)
    for sub, transport in ((tcp, "tcp"), (checked, "shm")):
        stats = sub.stats()
        assert (stats["transport"], stats["verified"], stats["unhashed"]) == (transport, "checksums", 0)
    # The checksummed announcement of the version it already holds: nothing is applied twice.
    assert shm.poll(300) is None
    assert shm.stats()["received"] == 1
    assert publisher.stats()["chunks_served"] == 3  # the tcp subscriber's, after the checksums


def test_while_the_newest_is_hashed_tcp_subscribers_fetch_nothing_older(subscriber, hash_gate):
    gate, entered = hash_gate
    with WeightPublisher(chunk_mb=CHUNK_MB, keep=2) as pub:
        gate.set()
        pub.publish(weights(1), 1)
        first = subscriber(pub.endpoint, transport="tcp")
        assert_weights(first.poll(5000), 1)  # v1 was hashed and announced with checksums
        gate.clear()
        entered.clear()
        pub.publish(weights(2), 2)
        late_tcp = subscriber(pub.endpoint, transport="tcp")
        late_shm = subscriber(pub.endpoint)
        assert_weights(late_shm.poll(5000), 2)  # LATEST answers with the newest: mapped at once
        assert late_shm.stats()["unhashed"] == 1
        for sub in (late_tcp, first):  # v2's checksums are asked for: v1 (still held) is not fetched
            assert sub.poll(300) is None and sub.stats()["waited_for_checksums"] >= 1
        assert entered.is_set()  # v2 is being hashed (held)
        assert late_tcp.stats()["received"] == 0 and pub.stats()["chunks_served"] == 3  # first's v1 only
        gate.set()
        for sub in (late_tcp, first):
            assert_weights(sub.poll(5000), 2)
            assert sub.stats()["rejected"] == 0


def test_retiring_a_version_while_it_is_hashed_is_clean(subscriber, hash_gate):
    gate, entered = hash_gate
    before = memfds()
    with WeightPublisher(chunk_mb=CHUNK_MB, keep=1) as pub:
        tcp = subscriber(pub.endpoint, transport="tcp")
        pub.publish(weights(1), 1)
        assert tcp.poll(300) is None and entered.wait(5)  # v1's hash, on request, holds its payload
        pub.publish(weights(2), 2)  # keep=1: v1 is retired in the background...
        pub._store._retire()  # ...and here too, so that it surely is (white box)
        gate.set()  # v1's hash finishes over the mapping it holds, and is not announced: v1 is gone
        assert_weights(tcp.poll(5000), 2)
        assert (tcp.stats()["received"], tcp.stats()["gone"], tcp.stats()["rejected"]) == (1, 0, 0)
        assert tcp.poll(200) is None
    assert memfds() <= before


def test_a_hash_superseded_before_it_starts_is_skipped(subscriber, monkeypatch):
    real, hashed = weight_publisher.add_checksums, []
    entered, go = threading.Semaphore(0), threading.Semaphore(0)

    def gated(header, payload, map_fn):
        entered.release()
        assert go.acquire(timeout=20)
        out = real(header, payload, map_fn)
        hashed.append(out.version)
        return out

    monkeypatch.setattr(weight_publisher, "add_checksums", gated)
    with WeightPublisher(chunk_mb=CHUNK_MB, keep=2) as pub:
        tcp = subscriber(pub.endpoint, transport="tcp")
        pub.publish(weights(1), 1)
        assert tcp.poll(300) is None and entered.acquire(timeout=5)  # asked for v1's: hashing, held
        pub.publish(weights(2), 2)
        assert tcp.poll(300) is None  # asks for v2's: queued behind v1's
        pub.publish(weights(3), 3)  # v2 is superseded before its hash starts
        go.release()
        assert tcp.poll(300) is None and entered.acquire(timeout=5)  # asks for v3's: the next to start
        go.release()
        assert_weights(tcp.poll(5000), 3)  # v1's checksums went out too, but v3's were due
        assert hashed == [1, 3]
        assert (tcp.stats()["received"], tcp.stats()["rejected"]) == (1, 0)


def test_closing_during_a_background_hash_is_clean(subscriber, monkeypatch):
    before = memfds()
    started, finished, seen = threading.Event(), threading.Event(), []
    real = weight_publisher.add_checksums
    pub = WeightPublisher(chunk_mb=CHUNK_MB, threads=1)  # 3 chunks, at least 3 pieces, one at a time
    closing = pub._store._stop  # white box: what close() sets before it waits for the hash

    def piece(fn, p):  # each piece lasts until close() has begun
        started.set()
        seen.append(closing.wait(20))
        return fn(p)

    def slow(header, payload, map_fn):
        out = real(header, payload, lambda fn, items: map_fn(functools.partial(piece, fn), items))
        finished.set()
        return out

    monkeypatch.setattr(weight_publisher, "add_checksums", slow)
    tcp = subscriber(pub.endpoint, transport="tcp")
    pub.publish(weights(1), 1)
    assert tcp.poll(300) is None and started.wait(5)  # it asked for the checksums
    pub.close()  # stops the hash after the piece under way, then releases everything
    assert seen == [True] and not finished.is_set()
    assert memfds() <= before
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(weights(2), 2)
