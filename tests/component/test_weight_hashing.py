"""Hashing on request: a sealed payload is announced without checksums, used at once over shared memory, and
hashed only when a subscriber needs checksums (NEED): then announced again with them. Also: a hash that is
superseded, retired or interrupted by close. Every wait is for a condition, with a deadline.
"""

import functools
import threading

import pytest

from learner import weight_payloads
from learner.weight_publisher import WeightPublisher
from tests import weight_fixtures
from tests.weight_fixtures import CHUNK_MB, WAIT_MS, assert_weights, idle_until, memfds, weights

publisher, subscriber = weight_fixtures.publisher, weight_fixtures.subscriber


@pytest.fixture
def hash_gate(monkeypatch):
    """Holds every background hash (after it has taken its payload) until `gate.set()`; `entered` is set
    once a hash is waiting. The checksum-less announcement is then the only one out."""
    gate, entered = threading.Event(), threading.Event()
    real = weight_payloads.add_checksums

    def gated(*args, **kwargs):
        entered.set()
        assert gate.wait(20), "hash gate never opened"
        return real(*args, **kwargs)

    monkeypatch.setattr(weight_payloads, "add_checksums", gated)
    yield gate, entered
    gate.set()


def test_unhashed_announcement_is_used_only_over_sealed_shared_memory(publisher, subscriber, hash_gate):
    gate, entered = hash_gate
    shm = subscriber(publisher.endpoint)
    tcp = subscriber(publisher.endpoint, transport="tcp")
    checked = subscriber(publisher.endpoint, verify_sealed=True)
    publisher.publish(weights(1), 1)
    assert_weights(shm.poll(WAIT_MS), 1)  # no checksum exists: the sealed memfd needs none
    stats = shm.stats()
    assert (stats["transport"], stats["verified"], stats["unhashed"]) == ("shm", "sealed", 1)
    late_shm = subscriber(publisher.endpoint)  # LATEST answers with the checksum-less announcement too
    assert_weights(late_shm.poll(WAIT_MS), 1)
    assert not entered.is_set() and not publisher.stats()["hashing"]  # nobody needed checksums yet
    for sub in (tcp, checked):  # set aside, not rejected: they ask for the checksums and wait
        idle_until(sub, lambda sub=sub: sub.stats()["waited_for_checksums"] >= 1)
        stats = sub.stats()
        assert (stats["version"], stats["rejected"], stats["received"]) == (-1, 0, 0), stats
    assert entered.wait(30) and publisher.stats()["hashing"]  # hashing on request (held here)
    assert publisher.stats()["chunks_served"] == 0
    gate.set()  # the same version, announced again with checksums
    assert_weights(tcp.poll(WAIT_MS), 1)
    assert_weights(checked.poll(WAIT_MS), 1)
    for sub, transport in ((tcp, "tcp"), (checked, "shm")):
        stats = sub.stats()
        assert (stats["transport"], stats["verified"], stats["unhashed"]) == (transport, "checksums", 0)
    # The checksummed announcement of the version it already holds (sent to every subscriber before tcp could
    # fetch a chunk, so it is in by now): nothing is applied twice.
    assert shm.poll(300) is None
    assert shm.stats()["received"] == 1
    assert publisher.stats()["chunks_served"] == 3  # the tcp subscriber's, after the checksums


def test_while_the_newest_is_hashed_tcp_subscribers_fetch_nothing_older(subscriber, hash_gate):
    gate, entered = hash_gate
    with WeightPublisher(chunk_mb=CHUNK_MB, keep=2) as pub:
        gate.set()
        pub.publish(weights(1), 1)
        first = subscriber(pub.endpoint, transport="tcp")
        assert_weights(first.poll(WAIT_MS), 1)  # v1 was hashed and announced with checksums
        gate.clear()
        entered.clear()
        pub.publish(weights(2), 2)
        late_tcp = subscriber(pub.endpoint, transport="tcp")
        late_shm = subscriber(pub.endpoint)
        assert_weights(late_shm.poll(WAIT_MS), 2)  # LATEST answers with the newest: mapped at once
        assert late_shm.stats()["unhashed"] == 1
        waited = {sub: sub.stats()["waited_for_checksums"] for sub in (late_tcp, first)}
        for sub in (late_tcp, first):  # v2's checksums are asked for: v1 (still held) is not fetched
            idle_until(sub, lambda sub=sub: sub.stats()["waited_for_checksums"] > waited[sub])
        assert entered.wait(30)  # v2 is being hashed (held)
        assert late_tcp.stats()["received"] == 0 and pub.stats()["chunks_served"] == 3  # first's v1 only
        gate.set()
        for sub in (late_tcp, first):
            assert_weights(sub.poll(WAIT_MS), 2)
            assert sub.stats()["rejected"] == 0


def test_retiring_a_version_while_it_is_hashed_is_clean(subscriber, hash_gate):
    gate, entered = hash_gate
    before = memfds()
    with WeightPublisher(chunk_mb=CHUNK_MB, keep=1) as pub:
        tcp = subscriber(pub.endpoint, transport="tcp")
        pub.publish(weights(1), 1)
        idle_until(tcp, entered.is_set)  # v1's hash, on request, holds its payload
        pub.publish(weights(2), 2)  # keep=1: v1 is retired in the background...
        pub._store._retire()  # ...and here too, so that it surely is (white box)
        gate.set()  # v1's hash finishes over the mapping it holds, and is not announced: v1 is gone
        assert_weights(tcp.poll(WAIT_MS), 2)
        assert (tcp.stats()["received"], tcp.stats()["gone"], tcp.stats()["rejected"]) == (1, 0, 0)
        assert tcp.poll(200) is None
    assert memfds() <= before


def test_a_hash_superseded_before_it_starts_is_skipped(subscriber, monkeypatch):
    real, hashed = weight_payloads.add_checksums, []
    entered, go = threading.Semaphore(0), threading.Semaphore(0)

    def gated(header, payload, map_fn):
        entered.release()
        assert go.acquire(timeout=20)
        out = real(header, payload, map_fn)
        hashed.append(out.version)
        return out

    monkeypatch.setattr(weight_payloads, "add_checksums", gated)
    with WeightPublisher(chunk_mb=CHUNK_MB, keep=2) as pub:
        tcp = subscriber(pub.endpoint, transport="tcp")
        pub.publish(weights(1), 1)
        idle_until(tcp, lambda: entered.acquire(timeout=0))  # asked for v1's: hashing, held
        pub.publish(weights(2), 2)
        idle_until(tcp, lambda: pub._store._hash_asked == 2)  # asked for v2's: queued behind v1's (white box)
        pub.publish(weights(3), 3)  # v2 is superseded before its hash starts
        go.release()
        idle_until(tcp, lambda: entered.acquire(timeout=0))  # asks for v3's: the next to start
        go.release()
        assert_weights(tcp.poll(WAIT_MS), 3)  # v1's checksums went out too, but v3's were due
        assert hashed == [1, 3]
        assert (tcp.stats()["received"], tcp.stats()["rejected"]) == (1, 0)


def test_closing_during_a_background_hash_is_clean(subscriber, monkeypatch):
    before = memfds()
    started, finished, seen = threading.Event(), threading.Event(), []
    real = weight_payloads.add_checksums
    pub = WeightPublisher(chunk_mb=CHUNK_MB, threads=1)  # 3 chunks, hashed one at a time
    closing = pub._store._stop  # white box: what close() sets before it waits for the hash

    def chunk(fn, k):  # each chunk's hash lasts until close() has begun
        started.set()
        seen.append(closing.wait(20))
        return fn(k)

    def slow(header, payload, map_fn):
        out = real(header, payload, lambda fn, items: map_fn(functools.partial(chunk, fn), items))
        finished.set()
        return out

    monkeypatch.setattr(weight_payloads, "add_checksums", slow)
    tcp = subscriber(pub.endpoint, transport="tcp")
    pub.publish(weights(1), 1)
    idle_until(tcp, started.is_set)  # it asked for the checksums
    pub.close()  # stops the hash after the chunk under way, then releases everything
    assert seen == [True] and not finished.is_set()
    assert memfds() <= before
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(weights(2), 2)
