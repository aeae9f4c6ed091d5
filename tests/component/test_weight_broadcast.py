"""Weight broadcast over real loopback sockets: versions, late joiners, corrupted messages, CURVE, binds.

The tcp path is exercised with transport="tcp"; subscribers on this host otherwise read the publisher's
shared-memory file. Corruption on the socket path comes from a raw ZeroMQ ROUTER speaking the protocol.
Hashing on request (a sealed payload announced without checksums): test_weight_hashing.py. Nothing waits a
fixed time for something to happen: a poll returns as soon as a version is in, every other wait is for a
condition, with a deadline (tests/waiting.py); a short poll that must return nothing is a check, not a wait.
"""

import json
import os
import struct
import threading

import numpy as np
import pytest
import zmq

from learner import weight_publisher
from learner.weight_publisher import WeightPublisher
from system import weight_channel
from system.weight_codec import WeightHeader, encode_weights
from system.weight_wire import META
from tests import weight_fixtures
from tests.waiting import wait_until
from tests.weight_fixtures import (
    CHUNK_MB,
    WAIT_MS,
    assert_weights,
    handshake_failures,
    idle_until,
    memfds,
    weights,
)

publisher, subscriber = weight_fixtures.publisher, weight_fixtures.subscriber


def test_one_subscriber_gets_each_version_once_and_a_snapshot(publisher, subscriber):
    sub = subscriber(publisher.endpoint)
    assert sub.poll(100) is None  # nothing published yet
    for v in (1, 2, 3):
        tensors = weights(v)
        publisher.publish(tensors, v)
        tensors["embed"] += 100  # the learner trains on in place: the published snapshot must not change
        assert_weights(sub.poll(WAIT_MS), v)
        assert sub.poll(0) is None  # nothing newer: nothing applied twice
    assert sub.stats()["transport"] == "shm" and sub.stats()["rejected"] == 0
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(weights(3), 3)
    with pytest.raises(TypeError, match="complex64"):
        publisher.publish({"c": np.zeros(2, np.complex64)}, 4)
    publisher.publish(weights(4), 4)  # a failed publish announces nothing and breaks nothing
    assert_weights(sub.poll(WAIT_MS), 4)


def test_three_subscribers_over_both_transports(publisher, subscriber):
    subs = [subscriber(publisher.endpoint, transport=t) for t in ("auto", "tcp", "tcp")]
    for v in (1, 2, 3):
        publisher.publish(weights(v), v)
        for sub in subs:
            assert_weights(sub.poll(WAIT_MS), v)
    assert [s.stats()["transport"] for s in subs] == ["shm", "tcp", "tcp"]
    assert publisher.stats()["chunks_served"] == 2 * 3 * 3  # 2 tcp subscribers x 3 versions x 3 chunks


def test_late_joiner_and_missed_versions_get_the_latest(publisher, subscriber):
    early = subscriber(publisher.endpoint, transport="tcp")
    for v in (1, 2, 3):
        publisher.publish(weights(v), v)
    late = subscriber(publisher.endpoint, transport="tcp")
    assert_weights(late.poll(WAIT_MS), 3)
    assert_weights(early.poll(WAIT_MS), 3)  # missed 1 and 2: only the newest is fetched
    assert early.poll(200) is None


def test_a_restarted_publisher_is_followed_even_with_lower_versions(subscriber):
    first = WeightPublisher(chunk_mb=CHUNK_MB)
    sub = subscriber(first.endpoint, refresh_s=0.1)
    first.publish(weights(5), 5)
    assert_weights(sub.poll(WAIT_MS), 5)
    port = first.port
    first.close()
    with WeightPublisher(port=port, chunk_mb=CHUNK_MB) as again:  # resumed from an older checkpoint
        again.publish(weights(3), 3)
        assert_weights(sub.poll(WAIT_MS), 3)
        assert sub.poll(300) is None


def test_same_host_payload_is_sealed_and_not_rehashed(publisher, subscriber):
    sub = subscriber(publisher.endpoint)
    checked = subscriber(publisher.endpoint, verify_sealed=True)
    publisher.publish(weights(1), 1)
    path = publisher.stats()["payload_path"]  # /proc/PID/fd/N of the memfd
    with pytest.raises(PermissionError, match="Operation not permitted"), open(path, "r+b") as f:
        f.write(b"x")  # sealed: the kernel refuses writes, to every process
    with pytest.raises(PermissionError, match="Operation not permitted"):
        os.truncate(path, 100)
    assert_weights(sub.poll(WAIT_MS), 1)
    assert_weights(checked.poll(WAIT_MS), 1)
    assert (sub.stats()["transport"], sub.stats()["verified"]) == ("shm", "sealed")
    assert (checked.stats()["transport"], checked.stats()["verified"]) == ("shm", "checksums")


def test_corrupted_or_truncated_unsealed_payload_is_rejected(subscriber):
    with WeightPublisher(chunk_mb=CHUNK_MB, seal=False) as pub:
        sub = subscriber(pub.endpoint)
        pub.publish(weights(1), 1)
        assert_weights(sub.poll(WAIT_MS), 1)
        pub.publish(weights(2), 2)
        with open(pub.stats()["payload_path"], "r+b") as f:  # flip one byte of the published payload
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0x01]))
        idle_until(sub, lambda: "checksum mismatch" in sub.stats()["last_error"])
        assert sub.stats()["version"] == 1 and sub.stats()["rejected"] >= 1
        pub.publish(weights(3), 3)
        os.truncate(pub.stats()["payload_path"], 100)
        idle_until(sub, lambda: "truncated" in sub.stats()["last_error"])
        assert sub.stats()["version"] == 1
        pub.publish(weights(4), 4)
        assert_weights(sub.poll(WAIT_MS), 4)  # recovers with the next good version
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
    assert_weights(sub.poll(WAIT_MS), 1)
    cases = [
        (2, flip(1), "v2: chunk 1 (16384, 32768) checksum mismatch"),
        (3, lambda c: [*c[:-1], c[-1][:-1]], "v3: chunk 2 has"),  # the last chunk one byte short
        (4, lambda c: [c[0], None, c[2]], "v4: timed out with chunks [1] of 3 missing"),
    ]
    for version, edit, error in cases:
        raw.set(version, edit)
        sub.request_latest()
        idle_until(sub, lambda error=error: error in sub.stats()["last_error"])
        assert sub.version == 1, sub.stats()
    assert sub.stats()["rejected"] >= 3
    raw.set(5)
    sub.request_latest()
    assert_weights(sub.poll(WAIT_MS), 5)  # the last good version stayed in force until this one


def test_curve_subscriber_needs_the_server_key(subscriber):
    with WeightPublisher(auth="curve", chunk_mb=CHUNK_MB) as pub:
        pub.publish(weights(1), 1)
        good = subscriber(pub.endpoint, server_public_key=pub.public_key, transport="tcp")
        no_key = subscriber(pub.endpoint)
        wrong_key = subscriber(pub.endpoint, server_public_key=zmq.curve_keypair()[0])
        assert_weights(good.poll(WAIT_MS), 1)
        for sub in (no_key, wrong_key):  # refused (a handshake under watch fails) ...
            with handshake_failures(sub._sock, pub.endpoint) as failed:
                wait_until(lambda f=failed, s=sub: s.poll(0) is None and f() >= 1)
        assert no_key.stats()["received"] == wrong_key.stats()["received"] == 0  # ... and got nothing
        assert pub.stats()["peers"] == 1  # only `good` reached the publisher (more: test_auth_refusal.py)


def test_non_loopback_bind_needs_curve():
    for host in ("0.0.0.0", "*", "10.1.2.3", "example.org"):
        with pytest.raises(ValueError, match="without auth='curve'"):
            WeightPublisher(bind_host=host)
    with pytest.raises(ValueError, match="auth must be"):
        WeightPublisher(auth="password")
    WeightPublisher(bind_host="0.0.0.0", auth="curve").close()
    WeightPublisher(bind_host="localhost").close()


def test_unknown_versions_and_bad_requests(publisher):
    publisher.publish(weights(1), 1)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.endpoint)
    dealer.send_multipart([b"GET", META.pack(99, 0, 7)])
    assert dealer.poll(WAIT_MS) and dealer.recv_multipart() == [b"GONE", META.pack(99, 0, 7)]
    dealer.send(b"NONSENSE")
    dealer.send_multipart([b"NEED", b"1"])  # the version is 8 bytes
    dealer.send(b"LATEST")
    assert dealer.poll(WAIT_MS) and dealer.recv_multipart()[0] == b"ANNOUNCE"  # after the two bad ones
    assert publisher.stats()["bad_requests"] == 2
    for _ in range(2):  # hashed on the first request, then answered from what is known
        dealer.send_multipart([b"NEED", struct.pack(">Q", 1)])
        assert dealer.poll(WAIT_MS)
        kind, header, _ = dealer.recv_multipart()
        assert kind == b"ANNOUNCE" and WeightHeader.from_bytes(header).has_checksums
    dealer.close(linger=0)
    wait_until(lambda: publisher.stats()["spare_ready"])  # its background allocation would skew the count
    before = memfds()
    with WeightPublisher(keep=1) as pub:
        for v in (1, 2, 3):
            pub.publish(weights(v), v)
        wait_until(lambda: pub.stats()["spare_ready"])  # retiring runs in the background, before the spare
        assert len(memfds() - before) <= 2  # the newest version + the pre-allocated spare
    assert memfds() <= before  # close releases every payload


def test_in_memory_twin_has_the_same_contract():
    assert weight_publisher.InMemoryWeightChannel is weight_channel.InMemoryWeightChannel  # re-exported
    ch = weight_channel.InMemoryWeightChannel(chunk_mb=CHUNK_MB)
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


def test_a_lagged_reader_gets_the_version_published_lag_steps_ago():
    # run.sampler_lag (runtime/local.py): a reader with lag 2 sees version v − 2 once the learner is at v.
    ch = weight_channel.InMemoryWeightChannel(chunk_mb=CHUNK_MB)
    late = ch.sink(lag=2)
    ch.publish(weights(0), 0)
    ch.publish(weights(1), 1)
    assert late.poll() is None  # newest 1: nothing at 1 − 2 = −1 yet
    ch.publish(weights(2), 2)
    assert_weights(late.poll(), 0)
    ch.publish(weights(3), 3)
    ch.publish(weights(4), 4)
    assert_weights(late.poll(), 2)  # newest 4 → version 2 (3 kept versions: 2, 3, 4)
    assert late.poll() is None and ch.poll()[0] == 4  # the unlagged reader still gets the newest
