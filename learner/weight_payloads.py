"""The shared-memory payloads of the weight broadcast (learner/weight_publisher.py): each published version
copied once into a memfd, sealed against writes and resizes, hashed chunk by chunk only when a subscriber
needs checksums; the newest `keep` stay, the next one is allocated and pre-faulted off the publish path."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from system.weight_codec import add_checksums, encode_weights

log = logging.getLogger("learner.weight_publisher")  # one logger for the broadcast's learner side
MEMFD = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
SEALS = sum(getattr(fcntl, f"F_SEAL_{name}", 0) for name in ("WRITE", "SHRINK", "GROW"))


class Payload:
    """One version's payload: a memfd on Linux (elsewhere plain memory, reachable only over the socket),
    written once through a read-write mapping, then `seal`ed and mapped read-only for serving chunks."""

    def __init__(self, size: int, prefault: bool) -> None:
        self.size, self.sealed, self.fd = size, False, -1
        self.mm: Any = bytearray(size)
        if not (MEMFD and size):
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

    def seal(self, enforce: bool) -> None:
        if self.fd < 0:
            return
        try:
            self.mm.close()  # F_SEAL_WRITE needs every writable mapping gone
            if enforce:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
                self.sealed = True
        except (BufferError, OSError):
            pass  # left unsealed: subscribers then verify every checksum
        if self.mm.closed:
            self.mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)

    def locator(self) -> dict[str, Any]:
        st = os.fstat(self.fd) if self.fd >= 0 else os.stat_result((0,) * 10)
        proc = f"/proc/{os.getpid()}/fd/{self.fd}" if self.fd >= 0 else ""
        return {"proc": proc, "dev": st.st_dev, "ino": st.st_ino, "bytes": self.size, "sealed": self.sealed}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if isinstance(self.mm, mmap.mmap):
            with contextlib.suppress(BufferError):  # in-flight zero-copy sends: unmapped after the last one
                self.mm.close()


class PayloadStore:
    """The newest `keep` payloads by version, plus one pre-allocated spare for the next publish. Retiring and
    the spare run on a thread at lower priority (same-host subscribers, and training, come first); hashing on
    request on its own, at normal priority, as a subscriber waits for it."""

    def __init__(self, keep: int, threads: int, prealloc: bool, seal: bool) -> None:
        self.keep, self.prealloc, self.seal = max(1, keep), prealloc, seal
        self._payloads: dict[int, Payload] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, "weight-copy") if threads > 1 else None
        self._bg = ThreadPoolExecutor(1, "weight-bg", initializer=lower_priority)
        self._hasher = ThreadPoolExecutor(1, "weight-hash")
        self._spare: Future[Payload] | None = None
        self._hashing: Future[None] | None = None
        self._hash_asked = -1  # newest version whose hash was requested (requests come from one thread)
        self._stop = threading.Event()
        self.hash_s = 0.0

    def _take(self, size: int) -> Payload:
        spare, self._spare = self._spare, None
        if spare is not None and _ready(spare) and spare.result().size == size:
            return spare.result()
        if spare is not None:  # not ready (or the wrong size): never wait for it on the publish path
            spare.add_done_callback(_close_future)
        return Payload(size, prefault=False)  # first publish or a new size: pages fault in as we copy

    def write(self, named: Mapping[str, Any], version: int, chunk_bytes: int) -> tuple[bytes, Payload, bool]:
        """-> (header, payload, whether the header has checksums). A payload that gets sealed is only copied
        here (`hash_later` hashes it if asked to); any other is hashed in the same pass as the copy."""
        holder: list[Payload] = []

        def sink(total: int) -> Any:
            holder.append(self._take(total))
            return holder[0].mm

        pmap = self._pool.map if self._pool is not None else map
        hashed = not (self.seal and MEMFD)
        try:  # [0]: the chunks, views of the writable mapping, are dropped at once (sealing needs them gone)
            header = encode_weights(named, version, chunk_bytes, sink=sink, map_fn=pmap, checksums=hashed)[0]
        except BaseException:
            for p in holder:  # e.g. an unsupported dtype: nothing was announced
                p.close()
            raise
        p = holder[0]
        p.seal(self.seal)
        if not (hashed or p.sealed):  # an empty payload, or the seal failed: never announce it unhashed
            header, hashed = add_checksums(header, p.mm, pmap).to_bytes(), True
        with self._lock:
            self._payloads[version] = p
        return header, p, hashed

    def after_announce(self, size: int) -> None:
        """Queue retiring old versions (slow for big payloads: not on the publish path), then the next one."""
        self._bg.submit(self._retire)
        if self.prealloc:  # the next publish copies into pages that already exist
            self._spare = self._bg.submit(Payload, size, True)

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

    def _hash(self, version: int, header: bytes, deliver: Callable[[bytes], Any]) -> None:
        with self._lock:
            p = self._payloads.get(version)
            if p is None or version < max(self._payloads) or self._stop.is_set():
                return  # retired, or superseded: the newer version's checksums follow
            # An export of the read-only mapping: a retiring close() cannot unmap it under us.
            view = np.frombuffer(p.mm, np.uint8)
        t0 = time.perf_counter()
        try:
            full = add_checksums(header, view, self._hash_map)
        except CancelledError:  # closing
            return
        except Exception:  # TCP subscribers then wait for the next version, or NEED this one again
            log.exception("background hash of weights v%d failed", version)
            self._hash_asked = min(self._hash_asked, version - 1)
            return
        finally:
            del view
        self.hash_s = time.perf_counter() - t0
        if version in self._payloads and not self._stop.is_set():  # not retired meanwhile
            deliver(full.to_bytes())

    def _hash_map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterable[Any]:
        """`map` over the copy threads that gives up once stopped (each item is one chunk)."""

        def one(x: Any) -> Any:
            if self._stop.is_set():
                raise CancelledError
            return fn(x)

        return self._pool.map(one, items) if self._pool is not None else map(one, items)

    def status(self) -> dict[str, Any]:
        """spare_ready: the next publish's payload is allocated; hashing: a hash is under way."""
        spare, hashing = self._spare, self._hashing
        return {
            "sealed": self.seal and MEMFD,
            "spare_ready": spare is None or spare.done(),
            "hashing": hashing is not None and not hashing.done(),
            "hash_s": self.hash_s,
        }

    def chunk(self, version: int, index: int, chunk_bytes: int) -> memoryview | None:
        lo = index * chunk_bytes
        with self._lock:  # the view is taken before a retiring publish can unmap the payload
            p = self._payloads.get(version)
            return None if p is None or lo >= p.size else memoryview(p.mm)[lo : min(lo + chunk_bytes, p.size)]

    def close(self) -> None:
        """Abandon background work (a running hash stops within a chunk), wait for it, free every payload."""
        self._stop.set()
        self._hasher.shutdown(wait=True, cancel_futures=True)
        self._bg.shutdown(wait=True, cancel_futures=True)
        if self._spare is not None:
            self._spare.add_done_callback(_close_future)
        if self._pool is not None:
            self._pool.shutdown()
        with self._lock:
            for p in self._payloads.values():
                p.close()
            self._payloads.clear()


def lower_priority() -> None:
    if sys.platform == "linux":  # a thread id names the calling thread only on Linux
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # below subscribers, not starved


def _ready(fut: Future[Payload]) -> bool:
    """A pre-allocated payload that is there to use: done, not cancelled (a cancelled future's exception()
    raises) and not failed."""
    return fut.done() and not fut.cancelled() and fut.exception() is None


def _close_future(fut: Future[Payload]) -> None:
    if _ready(fut):
        fut.result().close()
