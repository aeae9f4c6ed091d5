"""Weight broadcast, learner side: versioned weights over ZeroMQ, written once to shared memory.

One ROUTER socket, bound here; one DEALER per subscriber; frames, header and locator: system/weight_wire.py.
`publish` copies the tensors into a memfd (the snapshot: the learner may train on in place), seals it against
writes and resizes (kernel-enforced for every process) and announces it at once without checksums: same-host
subscribers map it and need none (N of them: one copy, no socket traffic, no hashing). A NEED (from a
subscriber elsewhere, or one verifying sealed payloads) has a background thread hash the sealed copy once,
chunk by chunk; the version is announced again with checksums and its chunks are pulled, sent copy=False
from the read-only mapping. A hash superseded by a newer version before it starts is skipped. An unsealed
payload (`seal=False`, or the seal failed) is hashed as it is copied. LATEST gets the newest announcement;
the newest `keep` versions stay fetchable, older ones answer GONE. Retiring old payloads, then allocating and
pre-faulting the next one, run off the publish path at lower priority. A memfd lives as long as a descriptor
or mapping of it: nothing to clean up after a SIGKILL. Not PUB/SUB: it drops whole messages at the
high-water mark and loses what is sent before a subscriber joins (docs/design.md §10.13); pulled chunks do
neither, and the GET window bounds what is queued per peer (so SNDHWM/RCVHWM are 0).

Security: binds 127.0.0.1 by default; any other address needs auth="curve" (ZeroMQ CURVE: traffic encrypted,
server authenticated; subscribers need `publisher.public_key`). A memfd opens through /proc only for processes
allowed to inspect the publisher (its user). `seal=False` leaves payloads writable (subscribers hash them).

Usage::

    pub = WeightPublisher()                        # pub.endpoint -> "tcp://127.0.0.1:PORT"
    pub.publish(model.state_dict(), version=step)  # returns once the snapshot is written and announced
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import zmq

from learner.weight_payloads import PayloadStore
from system.weight_channel import InMemoryWeightChannel  # noqa: F401  # re-exported for older imports
from system.weight_wire import ANNOUNCE, BYE, CHUNK, GET, GONE, LATEST, META, NEED, NONE, VERSION

log = logging.getLogger(__name__)
# The server thread's inproc line (not the wire): [_FULL or _UNHASHED, VERSION, header, locator], or [_STOP]
_FULL, _UNHASHED, _STOP = b"FULL", b"UNHASHED", b"STOP"


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # wildcards ("*") and host names are not loopback


class WeightPublisher:
    """`WeightSource` over ZeroMQ (see the module docstring). publish() from one thread at a time."""

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        chunk_mb: float = 4,
        auth: str = "none",
        curve_keys: tuple[bytes, bytes] | None = None,
        *,
        keep: int = 2,
        threads: int | None = None,
        prealloc: bool = True,
        seal: bool = True,
    ) -> None:
        if auth not in ("none", "curve"):
            raise ValueError(f"auth must be 'none' or 'curve', got {auth!r}")
        if auth == "none" and not _is_loopback(bind_host):
            raise ValueError(f"refusing to bind {bind_host!r} without auth='curve' (loopback only)")
        self.chunk_bytes = max(1, int(chunk_mb * 2**20))
        self._ctx = zmq.Context()
        self._sock = sock = self._ctx.socket(zmq.ROUTER)  # used by the server thread only
        opts = ((zmq.LINGER, 0), (zmq.ROUTER_MANDATORY, 1), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0))
        for opt, val in (*opts, (zmq.IPV6, int(":" in bind_host))):
            sock.setsockopt(opt, val)  # HWM 0: the subscriber's GET window bounds what is queued
        self.public_key: bytes | None = None
        if auth == "curve":
            self.public_key, secret = curve_keys or zmq.curve_keypair()
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, self.public_key, True
        host = f"[{bind_host.strip('[]')}]" if ":" in bind_host else bind_host
        sock.bind(f"tcp://{host}:{port or '*'}")  # "*": a free port
        self.port = int(sock.last_endpoint.rsplit(b":", 1)[1])
        self.endpoint = f"tcp://{host}:{self.port}"
        line = f"inproc://treeopsd-weights-{uuid.uuid4().hex}"  # to the server thread; sent on under _lock
        self._line, self._ctl = self._ctx.socket(zmq.PAIR), self._ctx.socket(zmq.PAIR)
        self._line.bind(line)
        self._ctl.connect(line)
        self._store = PayloadStore(keep, threads or min(4, os.cpu_count() or 1), prealloc, seal)
        self._lock = threading.Lock()
        self._peers: set[bytes] = set()
        self._announced: dict[bytes, tuple[int, list[bytes]]] = {}  # _FULL/_UNHASHED -> newest (v, frames)
        self.version, self._closed = -1, False
        self.incarnation = uuid.uuid4().hex  # lets subscribers tell a restarted publisher from a stale one
        self._stats: dict[str, Any] = {"publishes": 0, "payload_bytes": 0, "publish_s": 0.0}
        self._stats.update(payload_path="", chunks_served=0, bytes_served=0, latest_served=0, bad_requests=0)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    # ---- WeightSource ----------------------------------------------------------------------------------
    def publish(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Snapshot `named_tensors` as `version` (must increase) and announce it; returns without waiting
        for subscribers. Tensors may be torch (any dtype incl. bfloat16, any device) or numpy."""
        with self._lock:
            if self._closed:
                raise RuntimeError("WeightPublisher is closed")
            if version <= self.version:
                raise ValueError(f"version {version} is not newer than the last published {self.version}")
            t0 = time.perf_counter()
            header, p, hashed = self._store.write(named_tensors, version, self.chunk_bytes)
            locator = {**p.locator(), "publisher": self.incarnation}
            loc = json.dumps(locator).encode()
            self._ctl.send_multipart([_FULL if hashed else _UNHASHED, VERSION.pack(version), header, loc])
            self.version, s = version, self._stats
            s.update(publishes=s["publishes"] + 1, payload_bytes=p.size, payload_path=locator["proc"])
            s["publish_s"] = time.perf_counter() - t0
            self._store.after_announce(p.size)

    def stats(self) -> dict[str, Any]:
        """`publish_s`: the last publish (copy, seal, announce); `hash_s`: its background hash; `hashing`:
        one is under way (TCP subscribers wait for it)."""
        return {"version": self.version, "peers": len(self._peers), **self._stats, **self._store.status()}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no background hash delivers after this
        self._ctl.send(_STOP)
        self._thread.join(timeout=10)
        self._ctl.close()
        self._ctx.term()
        self._store.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- server thread: owns the ROUTER socket ---------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._line, zmq.POLLIN)
        while True:
            poller.poll()
            while self._line.poll(0):  # in order: a version's unhashed announcement precedes its full one
                kind, *msg = self._line.recv_multipart()
                if kind == _STOP:
                    self._sock.close(linger=0)
                    self._line.close(linger=0)
                    return
                self._announced[kind] = (VERSION.unpack(msg[0])[0], [ANNOUNCE, *msg[1:]])
                for peer in list(self._peers):
                    self._send(peer, self._announced[kind][1])
            while self._sock.poll(0):
                peer, *frames = self._sock.recv_multipart()
                self._handle(peer, frames)

    def _handle(self, peer: bytes, frames: list[bytes]) -> None:
        kind, arg = (frames[0], frames[1:]) if frames else (b"", [])
        full, unhashed = self._announced.get(_FULL), self._announced.get(_UNHASHED)
        if kind == LATEST:  # the newest announcement; of one version, the one with checksums
            self._peers.add(peer)
            self._stats["latest_served"] += 1
            newest = unhashed if unhashed is not None and (full is None or unhashed[0] > full[0]) else full
            self._send(peer, newest[1] if newest is not None else [NONE])
        elif kind == GET and len(arg) == 1 and len(arg[0]) == META.size:
            version, index, _ = META.unpack(arg[0])
            data = self._store.chunk(version, index, self.chunk_bytes)
            if data is None:  # retired (newer versions exist) or never published
                self._send(peer, [GONE, arg[0]])
                return
            # counted before the send: a subscriber that has every chunk must find them all counted
            self._stats["chunks_served"] += 1
            self._stats["bytes_served"] += data.nbytes
            self._send(peer, [CHUNK, arg[0], data])
        elif kind == NEED and len(arg) == 1 and len(arg[0]) == VERSION.size:
            # Sent if known, else hashed (once) and broadcast; ignored for a version a newer one superseded.
            self._peers.add(peer)
            (version,) = VERSION.unpack(arg[0])
            if full is not None and full[0] >= version:
                self._send(peer, full[1])
            elif unhashed is not None and unhashed[0] == version:
                deliver = functools.partial(self._hashed, version, unhashed[1][2])
                self._store.hash_later(version, unhashed[1][1], deliver)
        elif kind == BYE:
            self._peers.discard(peer)
        else:
            self._stats["bad_requests"] += 1

    def _hashed(self, version: int, locator: bytes, header: bytes) -> None:
        """On the hashing thread: hand `version`'s checksummed header to the server thread."""
        with self._lock:  # the line's other sender is publish()
            if not self._closed:
                self._ctl.send_multipart([_FULL, VERSION.pack(version), header, locator])

    def _send(self, peer: bytes, frames: list[Any]) -> None:
        try:
            self._sock.send_multipart([peer, *frames], copy=False)  # chunk bytes go out of the mapped file
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._peers.discard(peer)  # gone; it will say LATEST again if it comes back
