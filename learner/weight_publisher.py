"""Weight broadcast, learner side: versioned weights over ZeroMQ, written once to shared memory.

Protocol (one ROUTER socket bound by the publisher, one DEALER per subscriber; frames are bytes)::

    subscriber -> publisher                     publisher -> subscriber
    [LATEST]          hello / "what is newest"  [ANNOUNCE, header, locator]  (or [NONE])
    [GET, meta]       one chunk, meta = >QII    [CHUNK, meta, data]  (meta echoed; or [GONE, meta])
                      (version, chunk index, fetch tag)
    [BYE]             forget me
                                                on every publish: [ANNOUNCE, ...] to each known subscriber

`header` is `system/weight_codec.py`'s header (JSON + checksums); `locator` is JSON
``{"path", "dev", "ino", "bytes"}`` naming the file that holds the payload.

Flow. `publish` hashes and copies the tensors in one pass into a new file in /dev/shm (the snapshot: the
learner may train on in place; the next file is pre-allocated and pre-faulted in the background, at lowest
priority, so the copy runs at memcpy speed) and announces it. A subscriber that sees the file (same path,
device and inode: same host) maps it copy-on-write and verifies it in place: N local subscribers cost one
write and no socket traffic. Others pull chunks over the socket, `window` GETs in flight, sent copy=False
from the mapped file. A late joiner, or one that missed versions, asks LATEST. The newest `keep` versions stay
fetchable; older ones answer GONE. Published files are immutable (truncating one under a reader's mapping
would SIGBUS it); files of a dead publisher (SIGKILL) are swept when the next one starts on the host.

Why not PUB/SUB: it drops whole messages at the high-water mark and loses what is sent before a subscriber
has joined (feasibility.md §3). Pulling chunks has neither problem, and the GET window bounds what is queued
per peer, so SNDHWM/RCVHWM are 0. Why shared memory: over loopback TCP each subscriber costs a full copy
through the kernel; from /dev/shm it costs a mapping and one checksum pass.

Security: binds 127.0.0.1 by default; any other address needs auth="curve" (ZeroMQ CURVE: traffic encrypted
and the server authenticated; subscribers need `publisher.public_key`). Shared-memory files are mode 0600.

Usage::

    pub = WeightPublisher()                        # pub.endpoint -> "tcp://127.0.0.1:PORT"
    pub.publish(model.state_dict(), version=step)  # returns once the snapshot is written and announced
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import mmap
import os
import struct
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import zmq

from system.weight_codec import WeightAssembler, encode_weights

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; an older kernel just faults pages in lazily
META = struct.Struct(">QII")  # version, chunk index, fetch tag


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # wildcards ("*") and host names are not loopback


class _ShmFile:
    """One payload file: created, pre-allocated and mapped read-write; immutable once announced."""

    def __init__(self, path: str, size: int, prefault: bool) -> None:
        self.path, self.size = path, size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with contextlib.suppress(OSError):  # allocate now, not page by page during the copy
                os.posix_fallocate(fd, 0, size)
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if size else None
            st = os.fstat(fd)
            self.dev, self.ino = st.st_dev, st.st_ino
        finally:
            os.close(fd)
        if prefault and self.mm is not None:
            with contextlib.suppress(OSError, ValueError):
                self.mm.madvise(_MADV_POPULATE_WRITE)

    def buffer(self) -> Any:
        return self.mm if self.mm is not None else bytearray()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # mappings (ours, subscribers') stay valid after this
            os.unlink(self.path)


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # Linux: per-thread nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _sweep_orphans(directory: str, host_prefix: str) -> None:
    """Remove this host's payload files whose publisher is gone (a SIGKILLed learner cleans up nothing)."""
    for name in os.listdir(directory):
        pid = name[len(host_prefix) :].split("-")[0]
        if not name.startswith(host_prefix) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
        except PermissionError:
            pass  # alive, another user's


def _unlink_all(paths: set[str]) -> None:
    for p in list(paths):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


class _ShmStore:
    """Versioned payload files in /dev/shm (or the temp dir): the newest `keep` kept, one spare ready."""

    def __init__(self, shm_dir: str | None, keep: int, threads: int, prealloc: bool) -> None:
        default = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        self.dir = shm_dir or default
        host = f"treeopsd-w-{os.uname().nodename.replace('/', '_')}-"
        _sweep_orphans(self.dir, host)
        self._prefix = os.path.join(self.dir, f"{host}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.keep, self.prealloc = max(1, keep), prealloc
        self._counter = itertools.count(1)  # next() is atomic: the background thread creates files too
        self._files: dict[int, _ShmFile] = {}
        self._lock = threading.Lock()
        self._paths: set[str] = set()
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths)  # also at interpreter exit
        self._hash_pool = ThreadPoolExecutor(threads, "weight-hash") if threads > 1 else None
        # Lowest priority: pre-faulting must not steal CPU from subscribers verifying the last publish.
        self._bg = ThreadPoolExecutor(1, "weight-prealloc", initializer=_lower_priority)
        self._spare: Future[_ShmFile] | None = None

    def _new_file(self, size: int, prefault: bool) -> _ShmFile:
        f = _ShmFile(f"{self._prefix}-{next(self._counter)}", size, prefault)
        self._paths.add(f.path)
        return f

    def _take_file(self, size: int) -> _ShmFile:
        spare, self._spare = self._spare, None
        if spare is not None and spare.done() and spare.exception() is None and spare.result().size == size:
            return spare.result()
        if spare is not None:  # not ready (or the wrong size): never wait for it on the publish path
            spare.add_done_callback(self._drop_future)
        return self._new_file(size, prefault=False)  # first publish or a new size: fault pages as we copy

    def write(self, named: Mapping[str, Any], version: int, chunk_bytes: int) -> tuple[bytes, _ShmFile]:
        holder: list[_ShmFile] = []

        def sink(total: int) -> Any:
            holder.append(self._take_file(total))
            return holder[0].buffer()

        map_fn = self._hash_pool.map if self._hash_pool is not None else map
        header, _ = encode_weights(named, version, chunk_bytes, sink=sink, map_fn=map_fn)
        f = holder[0]
        with self._lock:
            self._files[version] = f
            for old in sorted(self._files)[: -self.keep]:
                self._drop(self._files.pop(old))
        if self.prealloc:  # the next publish copies into pages that already exist
            self._spare = self._bg.submit(self._new_file, f.size, True)
        return header, f

    @property
    def spare_ready(self) -> bool:
        return self._spare is None or self._spare.done()

    def chunk(self, version: int, index: int, chunk_bytes: int) -> memoryview | None:
        with self._lock:
            f = self._files.get(version)
        lo = index * chunk_bytes
        if f is None or lo >= f.size:
            return None
        return memoryview(f.buffer())[lo : min(lo + chunk_bytes, f.size)]

    def _drop(self, f: _ShmFile) -> None:
        f.unlink()
        self._paths.discard(f.path)
        # f.mm is not closed: zero-copy sends may still reference it; it is freed with the last view.

    def _drop_future(self, fut: Future[_ShmFile]) -> None:
        if fut.exception() is None:
            self._drop(fut.result())

    def close(self) -> None:
        if self._spare is not None:
            self._spare.add_done_callback(self._drop_future)
        self._bg.shutdown(wait=True)
        if self._hash_pool is not None:
            self._hash_pool.shutdown()
        with self._lock:
            for f in self._files.values():
                self._drop(f)
            self._files.clear()
        self._finalizer()


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
        shm_dir: str | None = None,
        keep: int = 2,
        threads: int | None = None,
        prealloc: bool = True,
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
        self._store = _ShmStore(shm_dir, keep, threads, prealloc)
        self._lock = threading.Lock()
        self._peers: set[bytes] = set()
        self.version, self._closed = -1, False
        self._stats: dict[str, Any] = {"publishes": 0, "payload_bytes": 0, "publish_s": 0.0, "shm_path": ""}
        self._stats.update({"chunks_served": 0, "bytes_served": 0, "latest_served": 0, "bad_requests": 0})
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
            header, f = self._store.write(named_tensors, version, self.chunk_bytes)
            locator = {"path": f.path, "dev": f.dev, "ino": f.ino, "bytes": f.size}
            self._ctl.send_multipart([b"NEW", header, json.dumps(locator).encode()])
            self.version = version
            self._stats["publishes"] += 1
            self._stats["payload_bytes"], self._stats["shm_path"] = f.size, f.path
            self._stats["publish_s"] = time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version, "peers": len(self._peers), "shm_dir": self._store.dir,
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
