"""Weight broadcast, learner side: versioned weights over ZeroMQ, written once to shared memory.

Protocol (one ROUTER socket bound by the publisher, one DEALER per subscriber; frames are bytes)::

    subscriber -> publisher                     publisher -> subscriber
    [LATEST]          hello / "what is newest"  [ANNOUNCE, header, locator]  (or [NONE])
    [GET, meta]       one chunk, meta = >QII    [CHUNK, meta, data]  (meta echoed; or [GONE, meta])
                      (version, chunk index, fetch tag)
    [BYE]             forget me
                                                on every publish: [ANNOUNCE, ...] to each known subscriber

`header` is `system/weight_codec.py`'s header (JSON + checksums); `locator` is JSON
``{"proc": "/proc/PID/fd/N", "dev", "ino", "bytes", "sealed", "publisher"}`` naming the memfd that holds the
payload and this publisher's incarnation (a restarted learner's versions are followed even if lower).

Flow. `publish` copies the tensors into a memfd and hashes the copy in the same pass (the snapshot: the
learner may train on in place; after each announcement the next memfd is allocated and pre-faulted in the
background, so the copy runs at memcpy speed), seals it against writes and resizes (F_SEAL_WRITE|SHRINK|GROW,
kernel-enforced for every process: no reader can see bytes other than the hashed ones) and announces it.
A subscriber on the same host opens the memfd through /proc, checks inode and seals, and maps it: N local
subscribers cost one copy, no socket traffic and no re-hashing. Any other subscriber pulls the chunks over the
socket, `window` GETs in flight, sent copy=False from the read-only mapping, each chunk checked on arrival.
A late joiner, or one that missed versions, asks LATEST. The newest `keep` versions stay fetchable; older ones
answer GONE. A memfd lives as long as a descriptor or mapping of it: nothing to clean up after a SIGKILL.

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
import mmap
import os
import struct
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq

from system.weight_codec import WeightAssembler, encode_weights

_MEMFD = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
_SEALS = sum(getattr(fcntl, f"F_SEAL_{name}", 0) for name in ("WRITE", "SHRINK", "GROW"))
META = struct.Struct(">QII")  # version, chunk index, fetch tag


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


class _PayloadStore:
    """The newest `keep` payloads by version, plus one pre-allocated spare for the next publish."""

    def __init__(self, keep: int, threads: int, prealloc: bool, seal: bool) -> None:
        self.keep, self.prealloc, self.seal = max(1, keep), prealloc, seal
        self._payloads: dict[int, _Payload] = {}
        self._lock = threading.Lock()
        self._hash_pool = ThreadPoolExecutor(threads, "weight-hash") if threads > 1 else None
        # Normal priority on purpose: a niced thread that holds the GIL while descheduled stalls the caller.
        self._bg = ThreadPoolExecutor(1, "weight-prealloc")
        self._spare: Future[_Payload] | None = None

    def _take(self, size: int) -> _Payload:
        spare, self._spare = self._spare, None
        if spare is not None and spare.done() and spare.exception() is None and spare.result().size == size:
            return spare.result()
        if spare is not None:  # not ready (or the wrong size): never wait for it on the publish path
            spare.add_done_callback(_close_future)
        return _Payload(size, prefault=False)  # first publish or a new size: pages fault in as we copy

    def write(self, named: Mapping[str, Any], version: int, chunk_bytes: int) -> tuple[bytes, _Payload]:
        holder: list[_Payload] = []

        def sink(total: int) -> Any:
            holder.append(self._take(total))
            return holder[0].mm

        map_fn = self._hash_pool.map if self._hash_pool is not None else map
        try:
            header, chunks = encode_weights(named, version, chunk_bytes, sink=sink, map_fn=map_fn)
        except BaseException:
            for p in holder:  # e.g. an unsupported dtype: nothing was announced
                p.close()
            raise
        del chunks  # views of the writable mapping: sealing needs them gone
        p = holder[0]
        p.seal(self.seal)
        with self._lock:
            self._payloads[version] = p
        return header, p

    def after_announce(self, size: int) -> None:
        """Off the announce path: retire old versions, start allocating the next payload."""
        with self._lock:
            for old in sorted(self._payloads)[: -self.keep]:
                self._payloads.pop(old).close()
        if self.prealloc:  # the next publish copies into pages that already exist
            self._spare = self._bg.submit(_Payload, size, True)

    @property
    def spare_ready(self) -> bool:
        return self._spare is None or self._spare.done()

    def chunk(self, version: int, index: int, chunk_bytes: int) -> memoryview | None:
        lo = index * chunk_bytes
        with self._lock:  # the view is taken before a retiring publish can unmap the payload
            p = self._payloads.get(version)
            return None if p is None or lo >= p.size else memoryview(p.mm)[lo : min(lo + chunk_bytes, p.size)]

    def close(self) -> None:
        if self._spare is not None:
            self._spare.add_done_callback(_close_future)
        self._bg.shutdown(wait=True)
        if self._hash_pool is not None:
            self._hash_pool.shutdown()
        with self._lock:
            for p in self._payloads.values():
                p.close()
            self._payloads.clear()


def _close_future(fut: Future[_Payload]) -> None:
    if fut.exception() is None:
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
        threads = threads or min(4, os.cpu_count() or 1)  # hashing threads (zlib releases the GIL)
        self._store = _PayloadStore(keep, threads, prealloc, seal)
        self._lock = threading.Lock()
        self._peers: set[bytes] = set()
        self.version, self._closed = -1, False
        self.incarnation = uuid.uuid4().hex  # lets subscribers tell a restarted publisher from a stale one
        self._stats: dict[str, Any] = {"publishes": 0, "payload_bytes": 0, "publish_s": 0.0}
        self._stats.update(payload_path="", chunks_served=0, bytes_served=0, latest_served=0, bad_requests=0)
        self._thread = threading.Thread(target=self._serve, args=(sock, ctl_server), daemon=True)
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
            header, p = self._store.write(named_tensors, version, self.chunk_bytes)
            locator = {**p.locator(), "publisher": self.incarnation}
            self._ctl.send_multipart([b"NEW", header, json.dumps(locator).encode()])
            self._stats["publish_s"] = time.perf_counter() - t0
            self.version = version
            self._stats["publishes"] += 1
            self._stats["payload_bytes"], self._stats["payload_path"] = p.size, locator["proc"]
            self._store.after_announce(p.size)

    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version, "peers": len(self._peers), "sealed": self._store.seal and _MEMFD,
            "spare_ready": self._store.spare_ready, **self._stats,
        }  # fmt: skip

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ctl.send(b"STOP")
        self._thread.join(timeout=10)
        self._ctl.close()
        self._ctx.term()
        self._store.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- server thread: owns the ROUTER socket ---------------------------------------------------------
    def _serve(self, sock: zmq.Socket, ctl: zmq.Socket) -> None:
        poller, announce = zmq.Poller(), [b"NONE"]
        poller.register(sock, zmq.POLLIN)
        poller.register(ctl, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if ctl in events:
                msg = ctl.recv_multipart()
                if msg[0] == b"STOP":
                    break
                announce = [b"ANNOUNCE", *msg[1:]]
                for peer in list(self._peers):
                    self._send(sock, peer, announce)
            while sock in events:
                try:
                    peer, *frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(sock, peer, frames, announce)
        sock.close(linger=0)
        ctl.close(linger=0)

    def _handle(self, sock: zmq.Socket, peer: bytes, frames: list[bytes], announce: list[bytes]) -> None:
        kind = frames[0] if frames else b""
        if kind == b"LATEST":
            self._peers.add(peer)
            self._stats["latest_served"] += 1
            self._send(sock, peer, announce)
        elif kind == b"GET" and len(frames) == 2 and len(frames[1]) == META.size:
            version, index, _ = META.unpack(frames[1])
            data = self._store.chunk(version, index, self.chunk_bytes)
            if data is None:  # retired (newer versions exist) or never published
                self._send(sock, peer, [b"GONE", frames[1]])
                return
            self._send(sock, peer, [b"CHUNK", frames[1], data])
            self._stats["chunks_served"] += 1
            self._stats["bytes_served"] += data.nbytes
        elif kind == b"BYE":
            self._peers.discard(peer)
        else:
            self._stats["bad_requests"] += 1

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
