"""Weight broadcast, learner side: versioned weights over ZeroMQ, written once to shared memory.

Protocol (one ROUTER socket bound by the publisher, one DEALER per subscriber; frames are bytes)::

    subscriber -> publisher                     publisher -> subscriber
    [LATEST]          hello / "what is newest"  [ANNOUNCE, header, locator]  (or [NONE])
    [GET, meta]       one chunk, meta = >QII    [CHUNK, meta, data]  (meta echoed; or [GONE, meta])
                      (version, chunk index, fetch tag)
    [NEED, v]         v's checksums (>Q)        [ANNOUNCE, ...] with them (to all, once hashed)
    [BYE]             forget me
                                                on every publish: [ANNOUNCE, ...] to each known subscriber

`header` is `system/weight_codec.py`'s header (JSON + checksums, or the layout alone: checksum "none");
`locator` is JSON ``{"proc": "/proc/PID/fd/N", "dev", "ino", "bytes", "sealed", "publisher"}`` naming the
memfd that holds the payload and this publisher's incarnation (a restarted learner's versions are followed
even if lower).

Flow. `publish` copies the tensors into a memfd (the snapshot: the learner may train on in place; after each
publish the next memfd is allocated and pre-faulted in the background, at lower priority, so the copy runs at
memcpy speed), seals it against writes and resizes (F_SEAL_WRITE|SHRINK|GROW, kernel-enforced for every
process: no reader can see bytes other than the copied ones) and announces it at once with a checksum-less
header. A subscriber on the same host opens the memfd through /proc, checks inode and seals, and maps it: N
local subscribers cost one copy, no socket traffic and no hashing. Any other subscriber (or one that verifies
sealed payloads anyway) asks NEED; the first request has a background thread hash the sealed copy (the copy
threads, read-only mapping) and the same version is announced again, with checksums; the subscriber then pulls
the chunks over the socket, `window` GETs in flight, sent copy=False from the read-only mapping, each chunk
checked on arrival. Hashing on request: no CPU for checksums nobody reads, and none taken from same-host
subscribers mapping a new version (on a small machine, hashing alongside them slows the fan-out). An unsealed
payload (`seal=False`, or sealing failed) is hashed while it is copied and only ever announced with checksums.
A requested hash that a newer version supersedes before it starts is skipped (that one was announced too). A
late joiner, or one that missed versions, asks LATEST: the answer is the newest announcement. The newest
`keep` versions stay fetchable; older ones answer GONE. A memfd lives as long as a descriptor or mapping of
it: nothing to clean up after a SIGKILL.

Why not PUB/SUB: it drops whole messages at the high-water mark and loses what is sent before a subscriber
has joined (feasibility.md §3). Pulling chunks has neither problem, and the GET window bounds what is queued
per peer, so SNDHWM/RCVHWM are 0. Why shared memory: over loopback TCP each subscriber costs a full copy
through the kernel and a checksum pass; a sealed memfd costs one page-table mapping per subscriber.

Security: binds 127.0.0.1 by default; any other address needs auth="curve" (ZeroMQ CURVE: traffic encrypted
and the server authenticated; subscribers need `publisher.public_key`). A memfd opens through /proc only for
processes allowed to inspect the publisher (its user). `seal=False` leaves payloads writable (tests inject
corruption that way; subscribers then hash everything).

Usage::

    pub = WeightPublisher()                        # pub.endpoint -> "tcp://127.0.0.1:PORT"
    pub.publish(model.state_dict(), version=step)  # returns once the snapshot is written and announced
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import mmap
import os
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq

from system.weight_codec import WeightAssembler, add_checksums, encode_weights

log = logging.getLogger(__name__)
_MEMFD = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
_SEALS = sum(getattr(fcntl, f"F_SEAL_{name}", 0) for name in ("WRITE", "SHRINK", "GROW"))
META = struct.Struct(">QII")  # version, chunk index, fetch tag
_VERSION = struct.Struct(">Q")  # in the publisher's own messages to its server thread
_BG_NICE = 10  # lower than the subscribers' and the learner's, yet not starved by them


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # wildcards ("*") and host names are not loopback


class _Payload:
    """One version's payload: a memfd on Linux (others: plain memory, reachable only over the socket).

    Written once through a read-write mapping, then `seal`ed: unmapped, sealed against writes and resizes
    (kernel-enforced, for every process), and mapped read-only for serving chunks.
    """

    def __init__(self, size: int, prefault: bool) -> None:
        self.size, self.sealed, self.fd, self.dev, self.ino = size, False, -1, 0, 0
        self.mm: Any = bytearray(size)
        if not (_MEMFD and size):
            return
        self.fd = os.memfd_create("treeopsd-weights", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        with contextlib.suppress(OSError):  # allocate now, not page by page during the copy
            os.posix_fallocate(self.fd, 0, size)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if prefault:  # fault every page in now, not during the publish copy (madvise would hold the GIL)
            pages = np.frombuffer(self.mm, np.uint8)[:: mmap.PAGESIZE]
            pages[:] = 0
            del pages  # an export of the mapping: sealing needs it gone
        st = os.fstat(self.fd)
        self.dev, self.ino = st.st_dev, st.st_ino

    def seal(self, enforce: bool) -> None:
        if self.fd < 0:
            return
        try:
            self.mm.close()  # F_SEAL_WRITE needs every writable mapping gone
            if enforce:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
                self.sealed = True
        except (BufferError, OSError):
            pass  # left unsealed: subscribers then verify every checksum
        if self.mm.closed:
            self.mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)

    def locator(self) -> dict[str, Any]:
        proc = f"/proc/{os.getpid()}/fd/{self.fd}" if self.fd >= 0 else ""
        return {"proc": proc, "dev": self.dev, "ino": self.ino, "bytes": self.size, "sealed": self.sealed}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if isinstance(self.mm, mmap.mmap):
            with contextlib.suppress(BufferError):  # in-flight zero-copy sends: unmapped after the last one
                self.mm.close()


class _Stopped(Exception):
    """The publisher is closing: a background hash gives up."""


class _PayloadStore:
    """The newest `keep` payloads by version, plus one pre-allocated spare for the next publish."""

    def __init__(self, keep: int, threads: int, prealloc: bool, seal: bool) -> None:
        self.keep, self.prealloc, self.seal = max(1, keep), prealloc, seal
        self._payloads: dict[int, _Payload] = {}
        self._newest = -1
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, "weight-copy") if threads > 1 else None
        # Off the publish path: retiring, then the next spare, on one thread at lower priority (not urgent:
        # same-host subscribers mapping the new version, and training, come first; its heavy calls release
        # the GIL, so it cannot hold that while descheduled for long); hashing on request, on its own thread
        # at normal priority, as a subscriber waits for it.
        self._bg = ThreadPoolExecutor(1, "weight-bg", initializer=_lower_priority)
        self._hasher = ThreadPoolExecutor(1, "weight-hash")
        self._spare: Future[_Payload] | None = None
        self._hashing: Future[None] | None = None
        self._hash_asked = -1  # newest version whose hash was requested (requests come from one thread)
        self._stop = threading.Event()
        self.hash_s = 0.0

    def _take(self, size: int) -> _Payload:
        spare, self._spare = self._spare, None
        if spare is not None and _ready(spare) and spare.result().size == size:
            return spare.result()
        if spare is not None:  # not ready (or the wrong size): never wait for it on the publish path
            spare.add_done_callback(_close_future)
        return _Payload(size, prefault=False)  # first publish or a new size: pages fault in as we copy

    def write(self, named: Mapping[str, Any], version: int, chunk_bytes: int) -> tuple[bytes, _Payload, bool]:
        """-> (header, payload, whether the header has checksums). A payload that gets sealed is only copied
        here (`hash_later` hashes it if asked to); any other is hashed in the same pass as the copy."""
        holder: list[_Payload] = []

        def sink(total: int) -> Any:
            holder.append(self._take(total))
            return holder[0].mm

        map_fn = self._pool.map if self._pool is not None else map
        later = self.seal and _MEMFD
        try:
            header, chunks = encode_weights(
                named, version, chunk_bytes, sink=sink, map_fn=map_fn, checksums=not later
            )
        except BaseException:
            for p in holder:  # e.g. an unsupported dtype: nothing was announced
                p.close()
            raise
        del chunks  # views of the writable mapping: sealing needs them gone
        p = holder[0]
        p.seal(self.seal)
        if later and not p.sealed:  # an empty payload, or the seal failed: never announce it unhashed
            header, later = add_checksums(header, p.mm, map_fn).to_bytes(), False
        with self._lock:
            self._payloads[version] = p
            self._newest = version
        return header, p, not later

    def after_announce(self, size: int) -> None:
        """Queue retiring old versions (freeing a large payload takes a while: not on the publish path), then
        allocating the next payload."""
        self._bg.submit(self._retire)
        if self.prealloc:  # the next publish copies into pages that already exist
            self._spare = self._bg.submit(_Payload, size, True)

    def _retire(self) -> None:
        with self._lock:
            old = [self._payloads.pop(v) for v in sorted(self._payloads)[: -self.keep]]
        for p in old:  # outside the lock: chunk() needs it; a view it handed out keeps its mapping alive
            p.close()

    def hash_later(self, version: int, header: bytes, deliver: Callable[[bytes], Any]) -> None:
        """Hash `version`'s sealed payload in the background (once), then `deliver` the checksummed header."""
        if version <= self._hash_asked:
            return
        self._hash_asked = version
        with contextlib.suppress(RuntimeError):  # closing: shut down already
            self._hashing = self._hasher.submit(self._hash, version, header, deliver)
            self._hashing.add_done_callback(_log_failure)

    def _hash(self, version: int, header: bytes, deliver: Callable[[bytes], Any]) -> None:
        with self._lock:
            p = self._payloads.get(version)
            if p is None or version < self._newest or self._stop.is_set():
                return  # retired, or superseded: the newer version's checksums follow
            # An export of the read-only mapping: a retiring close() cannot unmap it under us.
            view = np.frombuffer(p.mm, np.uint8)
        t0 = time.perf_counter()
        try:
            full = add_checksums(header, view, self._hash_map)
        except _Stopped:
            return
        except BaseException:
            self._hash_asked = min(self._hash_asked, version - 1)  # a later NEED may try again
            raise
        finally:
            del view
        self.hash_s = time.perf_counter() - t0
        if self.holds(version) and not self._stop.is_set():
            deliver(full.to_bytes())

    def _hash_map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterable[Any]:
        """`map` over the copy threads that gives up once stopped (a piece is at most a chunk)."""

        def piece(x: Any) -> Any:
            if self._stop.is_set():
                raise _Stopped
            return fn(x)

        return self._pool.map(piece, items) if self._pool is not None else map(piece, items)

    def holds(self, version: int) -> bool:
        with self._lock:
            return version in self._payloads

    @property
    def spare_ready(self) -> bool:
        return self._spare is None or self._spare.done()

    @property
    def hashing(self) -> bool:
        return self._hashing is not None and not self._hashing.done()

    def chunk(self, version: int, index: int, chunk_bytes: int) -> memoryview | None:
        lo = index * chunk_bytes
        with self._lock:  # the view is taken before a retiring publish can unmap the payload
            p = self._payloads.get(version)
            return None if p is None or lo >= p.size else memoryview(p.mm)[lo : min(lo + chunk_bytes, p.size)]

    def stop(self) -> None:
        """Abandon background work (a running hash stops within a piece) and wait for its thread."""
        self._stop.set()
        self._hasher.shutdown(wait=True, cancel_futures=True)
        self._bg.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        self.stop()
        if self._spare is not None:
            self._spare.add_done_callback(_close_future)
        if self._pool is not None:
            self._pool.shutdown()
        with self._lock:
            for p in self._payloads.values():
                p.close()
            self._payloads.clear()


def _lower_priority() -> None:
    if sys.platform == "linux":  # a thread id names the calling thread only on Linux
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _BG_NICE)


def _log_failure(fut: Future[None]) -> None:
    if not fut.cancelled() and fut.exception() is not None:  # TCP subscribers then wait for the next version
        log.error("background hash of a weight payload failed", exc_info=fut.exception())


def _ready(fut: Future[_Payload]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None


def _close_future(fut: Future[_Payload]) -> None:
    if _ready(fut):
        fut.result().close()


class WeightPublisher:
    """`WeightSource` over ZeroMQ (protocol in the module docstring). publish() from one thread at a time."""

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
        sock = self._ctx.socket(zmq.ROUTER)
        for opt, val in ((zmq.LINGER, 0), (zmq.ROUTER_MANDATORY, 1), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
            sock.setsockopt(opt, val)  # HWM 0: the subscriber's GET window bounds what is queued
        self.public_key: bytes | None = None
        if auth == "curve":
            self.public_key, secret = curve_keys or zmq.curve_keypair()
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, self.public_key, True
        host = f"[{bind_host.strip('[]')}]" if ":" in bind_host else bind_host
        sock.setsockopt(zmq.IPV6, int(":" in bind_host))
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        self.port, self.endpoint = port, f"tcp://{host}:{port}"
        ctl_addr = f"inproc://treeopsd-weights-{uuid.uuid4().hex}"
        ctl_server = self._ctx.socket(zmq.PAIR)
        ctl_server.bind(ctl_addr)
        self._ctl = self._ctx.socket(zmq.PAIR)
        self._ctl.connect(ctl_addr)
        hashed_server = self._ctx.socket(zmq.PAIR)  # the background hash's own line to the server thread
        hashed_server.bind(f"{ctl_addr}-hashed")
        self._hashed = self._ctx.socket(zmq.PAIR)
        self._hashed.connect(f"{ctl_addr}-hashed")
        threads = threads or min(4, os.cpu_count() or 1)  # copying/hashing threads (release the GIL)
        self._store = _PayloadStore(keep, threads, prealloc, seal)
        self._lock = threading.Lock()
        self._peers: set[bytes] = set()
        self.version, self._closed = -1, False
        self.incarnation = uuid.uuid4().hex  # lets subscribers tell a restarted publisher from a stale one
        self._stats: dict[str, Any] = {"publishes": 0, "payload_bytes": 0, "publish_s": 0.0}
        self._stats.update(payload_path="", chunks_served=0, bytes_served=0, latest_served=0, bad_requests=0)
        self._thread = threading.Thread(
            target=self._serve, args=(sock, ctl_server, hashed_server), daemon=True
        )
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
            ver, loc = _VERSION.pack(version), json.dumps(locator).encode()
            self._ctl.send_multipart([b"FULL" if hashed else b"UNHASHED", ver, header, loc])
            self._stats["publish_s"] = time.perf_counter() - t0
            self.version = version
            self._stats["publishes"] += 1
            self._stats["payload_bytes"], self._stats["payload_path"] = p.size, locator["proc"]
            self._store.after_announce(p.size)

    def stats(self) -> dict[str, Any]:
        """`publish_s`: the last publish (copy, seal, announce); `hash_s`: its background hash; `hashing`:
        one is under way (TCP subscribers wait for it)."""
        store = self._store
        return {
            "version": self.version, "peers": len(self._peers), "sealed": store.seal and _MEMFD,
            "spare_ready": store.spare_ready, "hashing": store.hashing, **self._stats, "hash_s": store.hash_s,
        }  # fmt: skip

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._store.stop()  # nothing sends on self._hashed after this
        self._ctl.send(b"STOP")
        self._thread.join(timeout=10)
        self._ctl.close()
        self._hashed.close()
        self._ctx.term()
        self._store.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- server thread: owns the ROUTER socket ---------------------------------------------------------
    def _serve(self, sock: zmq.Socket, ctl: zmq.Socket, hashed: zmq.Socket) -> None:
        poller = zmq.Poller()
        for s in (sock, ctl, hashed):
            poller.register(s, zmq.POLLIN)
        latest: dict[bytes, tuple[int, list[bytes]]] = {}  # FULL / UNHASHED -> newest (version, ANNOUNCE)
        while True:
            events = dict(poller.poll())
            for line in (ctl, hashed):  # ctl first: a version's unhashed announcement precedes its full one
                if line not in events:
                    continue
                kind, *msg = line.recv_multipart()
                if kind == b"STOP":
                    for own in (sock, ctl, hashed):
                        own.close(linger=0)
                    return
                announce = [b"ANNOUNCE", *msg[1:]]
                latest[kind] = (_VERSION.unpack(msg[0])[0], announce)
                for peer in list(self._peers):
                    self._send(sock, peer, announce)
            while sock in events:
                try:
                    peer, *frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(sock, peer, frames, latest)

    @staticmethod
    def _latest(latest: dict[bytes, tuple[int, list[bytes]]]) -> list[bytes]:
        """The answer to LATEST: the newest announcement; of one version, the one with checksums."""
        full, unhashed = latest.get(b"FULL"), latest.get(b"UNHASHED")
        if unhashed is not None and (full is None or unhashed[0] > full[0]):
            return unhashed[1]
        return full[1] if full is not None else [b"NONE"]

    def _handle(
        self, sock: zmq.Socket, peer: bytes, frames: list[bytes], latest: dict[bytes, tuple[int, list[bytes]]]
    ) -> None:
        kind = frames[0] if frames else b""
        if kind == b"LATEST":
            self._peers.add(peer)
            self._stats["latest_served"] += 1
            self._send(sock, peer, self._latest(latest))
        elif kind == b"GET" and len(frames) == 2 and len(frames[1]) == META.size:
            version, index, _ = META.unpack(frames[1])
            data = self._store.chunk(version, index, self.chunk_bytes)
            if data is None:  # retired (newer versions exist) or never published
                self._send(sock, peer, [b"GONE", frames[1]])
                return
            self._send(sock, peer, [b"CHUNK", frames[1], data])
            self._stats["chunks_served"] += 1
            self._stats["bytes_served"] += data.nbytes
        elif kind == b"NEED" and len(frames) == 2 and len(frames[1]) == _VERSION.size:
            self._need(sock, peer, _VERSION.unpack(frames[1])[0], latest)
        elif kind == b"BYE":
            self._peers.discard(peer)
        else:
            self._stats["bad_requests"] += 1

    def _need(
        self, sock: zmq.Socket, peer: bytes, version: int, latest: dict[bytes, tuple[int, list[bytes]]]
    ) -> None:
        """A subscriber needs `version`'s checksums: send them if known, else hash it (once) and broadcast
        them. A request for a version that a newer one superseded is ignored: that one was announced too."""
        self._peers.add(peer)
        full, unhashed = latest.get(b"FULL"), latest.get(b"UNHASHED")
        if full is not None and full[0] >= version:
            self._send(sock, peer, full[1])
        elif unhashed is not None and unhashed[0] == version:
            ver, header, loc = _VERSION.pack(version), unhashed[1][1], unhashed[1][2]
            # The delivery runs on the hashing thread, the only one that sends on _hashed.
            self._store.hash_later(
                version, header, lambda h: self._hashed.send_multipart([b"FULL", ver, h, loc])
            )

    def _send(self, sock: zmq.Socket, peer: bytes, frames: list[Any]) -> None:
        try:
            sock.send_multipart([peer, *frames], copy=False)  # chunk bytes go out of the mapped file
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._peers.discard(peer)  # gone; it will say LATEST again if it comes back


class InMemoryWeightChannel:
    """In-process twin of WeightPublisher + WeightSubscriber (`WeightSource` and `WeightSink` in one): the
    same codec and checks, no sockets, no files. `sink()` gives another independent reader of the channel.

    Usage::

        ch = InMemoryWeightChannel()
        ch.publish(model.state_dict(), version=1)
        version, tensors = ch.poll()        # None when nothing newer than the last poll
    """

    def __init__(self, chunk_mb: float = 4, bfloat16: str = "torch", _shared: _Latest | None = None) -> None:
        self.chunk_bytes = max(1, int(chunk_mb * 2**20))
        self.bfloat16 = bfloat16
        self._shared = _shared or _Latest()
        self.version = -1  # last version returned by poll

    def sink(self) -> InMemoryWeightChannel:
        return InMemoryWeightChannel(self.chunk_bytes / 2**20, self.bfloat16, self._shared)

    def publish(self, named_tensors: Mapping[str, Any], version: int) -> None:
        box = self._shared
        if version <= box.version:
            raise ValueError(f"version {version} is not newer than the last published {box.version}")
        payload = bytearray()  # the copy into it is the snapshot
        sink = lambda n: payload.extend(bytes(n)) or payload  # noqa: E731
        header, _ = encode_weights(named_tensors, version, self.chunk_bytes, sink=sink)
        with box.cond:
            box.version, box.message = version, (header, bytes(payload))
            box.cond.notify_all()

    def poll(self, timeout_ms: int = 0) -> tuple[int, dict[str, Any]] | None:
        box = self._shared
        with box.cond:
            if not box.cond.wait_for(lambda: box.version > self.version, timeout_ms / 1000):
                return None
            header, payload = box.message
        asm = WeightAssembler(header, bytearray(payload))  # a private copy per reader
        asm.verify_buffer()
        self.version = asm.header.version
        return self.version, asm.finish(self.bfloat16)


class _Latest:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = -1
        self.message: tuple[bytes, bytes] = (b"", b"")
