"""Shared by the weight broadcast tests (test_weight_broadcast.py, test_weight_hashing.py): the weights and
their check, publisher/subscriber fixtures, the payload memfds this process holds, `idle_until`, and
`handshake_failures` (a ZeroMQ socket's refused CURVE handshakes, as its monitor reports them).

Fixtures are taken into a test module by assignment (``publisher = weight_fixtures.publisher``).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from actors.weight_subscriber import WeightSubscriber
from learner.weight_publisher import WeightPublisher
from tests.waiting import wait_until

CHUNK_MB = 1 / 64  # 16 KiB chunks: the ~40 KiB payload below spans three
WAIT_MS = 30_000  # for what must come: a poll returns as soon as it does


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


def idle_until(sub: WeightSubscriber, pred, timeout_s: float = 30.0) -> None:
    """Poll `sub`, which must apply no version meanwhile, until `pred()` holds (at most `timeout_s`)."""

    def step():
        got = sub.poll(20)
        assert got is None, f"applied v{got[0]} while waiting"
        return pred()

    wait_until(step, timeout_s, interval_s=0)


_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL}
_FAILED.add(zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@contextlib.contextmanager
def handshake_failures(sock: zmq.Socket, endpoint: str):
    """Yields a function counting the failed handshakes (a refused CURVE peer) of `sock` since entry, as its
    monitor reports them: a refusal observed, not a quiet window waited out. Single-threaded like `sock`.

    `sock` is connected to `endpoint` again once its monitor is attached, so that at least one handshake
    happens under watch: libzmq retries a handshake that failed on a dropped connection (NO_DETAIL), but
    not one that failed on the peer's greeting (PROTOCOL, a mechanism mismatch), and which of the two a
    refused peer sees first is a race. Waiting for a second failure, or for any failure of a connection
    made before the monitor, therefore hung now and then (it did under load)."""
    monitor = sock.get_monitor_socket()
    seen: list[int] = []
    sock.disconnect(endpoint)
    sock.connect(endpoint)

    def count() -> int:
        while monitor.poll(0):
            seen.append(recv_monitor_message(monitor)["event"])
        return sum(e in _FAILED for e in seen)

    try:
        yield count
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)  # before the subscriber's context is terminated


def memfds() -> set[int]:
    """Inodes of the payload memfds this process holds open (a mapping holds its own descriptor too)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # e.g. the descriptor listdir itself used
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:treeopsd"):
                inodes.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
    return inodes


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
