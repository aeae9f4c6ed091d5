"""Weight broadcast over real loopback sockets: versions, late joiners, corrupted messages, CURVE, binds.

The tcp path is exercised with transport="tcp"; subscribers on this host otherwise read the publisher's
shared-memory file. Corruption on the socket path comes from a raw ZeroMQ ROUTER speaking the protocol.
"""

import contextlib
import json
import os
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from actors.weight_subscriber import META, WeightSubscriber
from learner.weight_publisher import InMemoryWeightChannel, WeightPublisher
from system.weight_codec import encode_weights

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
    dealer.send(b"LATEST")
    assert dealer.poll(5000) and dealer.recv_multipart()[0] == b"ANNOUNCE"
    assert publisher.stats()["bad_requests"] == 1
    dealer.close(linger=0)
    while not publisher.stats()["spare_ready"]:  # its background allocation would skew the count
        time.sleep(0.01)
    before = memfds()
    with WeightPublisher(keep=1) as pub:
        for v in (1, 2, 3):
            pub.publish(weights(v), v)
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
