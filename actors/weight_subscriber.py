"""Weight broadcast, sampler side: the `WeightSink` over ZeroMQ (frames: system/weight_wire.py; flow:
learner/weight_publisher.py).

`poll` returns only complete versions newer than the last one it returned, verified against their checksums
or read from a sealed memfd. A version whose header or chunks fail their checks (system/weight_codec.py), or
that is truncated or incomplete, is rejected: logged, counted in `stats()`, the last good version stays in
force, and the latest is asked for again (at most `max_retries` times per version; after that only a newer
announcement is tried).

Where the payload comes from: on the publisher's host, its memfd (opened through /proc/PID/fd/N, checked to be
the announced inode, mapped copy-on-write). If the memfd is sealed against writes and resizes, its bytes are
the ones the publisher wrote and nobody can change them, so they are not hashed (`verify_sealed=True` hashes
them anyway); an unsealed one is verified chunk by chunk (the chunks cover every byte). Anywhere else:
chunks over the socket, `window` requests in flight, each checked on arrival. `stats()["transport"]` says
which ("shm" or "tcp") and `stats()["verified"]` how ("sealed" or "checksums").

The publisher announces a sealed payload without checksums. That is used only where checksums would prove
nothing: through shared memory, sealed, and `verify_sealed=False` (`stats()["unhashed"]` counts those
versions). Otherwise it is set aside, not rejected (`stats()["waited_for_checksums"]`), the publisher is asked
(NEED) to hash it, and its second announcement, with checksums, is fetched instead; older versions are not
fetched meanwhile (hashing takes less than fetching any version over a socket).

Usage (the sampler polls it from one worker thread, actors/weight_gate.py, and loads what it returns
between turns, `load_version`)::

    sub = WeightSubscriber(pub.endpoint)              # + server_public_key=pub.public_key with CURVE
    got = sub.poll(timeout_ms=0)                      # (version, tensors) or None

Arrays are numpy (writable views of one private buffer or mapping); bfloat16 tensors come back as
torch.bfloat16 tensors (numpy has no bfloat16), or as raw uint16 bits with `bfloat16="uint16"`. A version
mapped from a sealed memfd comes as `ReceivedWeights` with that memfd held open (`.memfd`) until the version
is dropped, so a vLLM sampler's workers can map the same bytes (actors/received_weights.py).
Not thread-safe: one thread polls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from actors.received_weights import ReceivedWeights, SealedMemfd, is_sealed, prefault
from system.weight_codec import WeightAssembler, WeightHeader, WeightMessageError
from system.weight_wire import ANNOUNCE, BYE, CHUNK, GET, GONE, LATEST, META, NEED, NONE, VERSION

log = logging.getLogger(__name__)


class _Gone(Exception):
    """The publisher no longer holds the version being fetched (newer ones replaced it)."""


class WeightSubscriber:
    """`WeightSink` fed by a `WeightPublisher` at `endpoint`; see the module docstring."""

    def __init__(
        self,
        endpoint: str,
        server_public_key: bytes | None = None,
        *,
        transport: str = "auto",
        window: int = 8,
        fetch_timeout_s: float = 30.0,
        refresh_s: float = 2.0,
        threads: int | None = None,
        bfloat16: str = "torch",
        verify_sealed: bool = False,
        max_retries: int = 1,
    ) -> None:
        if transport not in ("auto", "tcp"):
            raise ValueError(
                f"transport must be 'auto' (shared memory when possible) or 'tcp', got {transport!r}"
            )
        self.endpoint, self.transport, self.window = endpoint, transport, max(1, window)
        self.fetch_timeout_s, self.refresh_s, self.max_retries = fetch_timeout_s, refresh_s, max_retries
        self.bfloat16, self.verify_sealed = bfloat16, verify_sealed
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.IPV6, int("[" in endpoint))):
            self._sock.setsockopt(opt, val)
        if server_public_key is not None:
            self._sock.curve_serverkey = server_public_key
            self._sock.curve_publickey, self._sock.curve_secretkey = zmq.curve_keypair()
        self._sock.connect(endpoint)
        threads = threads or min(4, os.cpu_count() or 1)  # verifying threads (zlib releases the GIL)
        self._pool = ThreadPoolExecutor(threads, "weight-verify") if threads > 1 else None
        self.version = -1  # last version returned by poll
        self._offer: tuple[WeightHeader, dict[str, Any]] | None = None
        self._awaiting: tuple[int, Any] | None = None  # (version, publisher) whose checksums are due
        self._source: str | None = None  # the publisher incarnation that sent `version`
        self._failures: dict[int, int] = {}
        self._tag = 0
        self._asked = 0.0
        self._stats: dict[str, Any] = {"received": 0, "rejected": 0, "gone": 0, "bad_messages": 0}
        self._stats.update(unhashed=0, waited_for_checksums=0, unsent=0)
        self._stats.update({"last_error": "", "fetch_s": 0.0, "transport": "", "verified": "", "bytes": 0})
        self.request_latest()

    # ---- WeightSink ------------------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 0) -> tuple[int, dict[str, Any]] | None:
        """Wait up to `timeout_ms` for a newer version; fetch, verify and return it, else None.

        Once an announcement is in hand the fetch runs to the end (bounded by `fetch_timeout_s`)."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            while self._sock.poll(0):
                self._on_message(self._sock.recv_multipart())
            if self._offer is not None:
                got = self._fetch(*self._offer)
                if got is not None:
                    return got
                continue
            now = time.monotonic()
            if now - self._asked > self.refresh_s:  # a lost announcement or a restarted publisher
                self.request_latest()
            if now >= deadline:
                return None
            self._sock.poll(max(1, int((min(deadline, self._asked + self.refresh_s) - now) * 1000)))

    def request_latest(self) -> None:
        """Ask the publisher for its newest version (also how a late joiner catches up)."""
        self._send([LATEST])  # not sent (no peer yet): asked again at the next refresh
        self._asked = time.monotonic()

    def stats(self) -> dict[str, Any]:
        return {"version": self.version, **self._stats}

    def metrics(self) -> dict[str, float]:
        """For the sampler's metrics: versions refused (a bad hash, a stale or foreign publisher)."""
        return {"weights/rejected": float(self._stats.get("rejected", 0))}

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send(BYE, zmq.NOBLOCK)
        self._sock.close(linger=0)
        self._ctx.term()
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, frames: list[bytes]) -> bool:
        """Send without blocking; False (counted in `stats()["unsent"]`) when no publisher is connected. A
        DEALER with no peer blocks a send forever: a publisher that is down, or that refused this subscriber's
        handshake (no or a wrong CURVE key), must not hang `poll`, whose wait is bounded."""
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self._stats["unsent"] += 1
            return False
        return True

    # ---- messages ---------------------------------------------------------------------------------------
    def _on_message(self, frames: list[bytes]) -> None:
        kind = frames[0] if frames else b""
        if kind == ANNOUNCE and len(frames) == 3:
            try:
                header = WeightHeader.from_bytes(frames[1])
                locator = json.loads(frames[2])
                if not isinstance(locator, dict):
                    raise ValueError(f"the locator is a JSON {type(locator).__name__}, not an object")
            except (WeightMessageError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
                self._reject(-1, WeightMessageError(f"bad announcement: {e}"))
                return
            v, source = header.version, locator.get("publisher")
            pending = self._offer[0] if self._offer is not None else None
            if self._offer is not None:
                base_v, base_source = self._offer[0].version, self._offer[1].get("publisher")
            else:
                base_v, base_source = self.version, self._source
            # A restarted publisher is followed even with lower versions: its learner resumed from an older
            # checkpoint, and those are the weights being trained now.
            newer = v > base_v or source != base_source
            if not header.has_checksums and not self._may_map_unhashed(locator):
                if newer:
                    self._wait_for_checksums(v, source)
                return
            if self._awaiting is not None and source == self._awaiting[1]:
                if v < self._awaiting[0]:
                    return  # older than the version whose checksums are on their way
                self._awaiting = None
            # The same version with checksums replaces a pending one without: it is usable on any transport.
            upgrade = pending is not None and not pending.has_checksums and header.has_checksums
            upgrade = upgrade and (v, source) == (base_v, base_source)
            if (newer or upgrade) and self._failures.get(v, 0) <= self.max_retries:
                self._offer = (header, locator)
        elif kind not in (NONE, CHUNK, GONE):  # late chunks of an abandoned fetch are expected
            self._stats["bad_messages"] += 1

    def _wait_for_checksums(self, version: int, source: Any) -> None:
        """Set a checksum-less announcement aside (not a failure) and ask for its checksummed twin; nothing
        older is fetched meanwhile (on a late joiner too, as LATEST answers with the newest only)."""
        self._stats["waited_for_checksums"] += 1
        self._awaiting, self._offer = (version, source), None
        self._send([NEED, VERSION.pack(version)])  # not sent: the next refresh's announcement asks again

    def _may_map_unhashed(self, locator: dict[str, Any]) -> bool:
        """Whether a checksum-less announcement can serve here: its memfd, sealed, is mapped from this host
        and the seal is trusted (seals are checked again on opening it)."""
        path = locator.get("proc")
        if self.transport == "tcp" or self.verify_sealed or locator.get("sealed") is not True:
            return False
        if not isinstance(path, str) or not path.startswith("/proc/"):
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False  # another host or container, or already retired
        return (st.st_dev, st.st_ino) == (locator.get("dev"), locator.get("ino"))

    def _reject(self, version: int, err: Exception) -> None:
        self._stats["rejected"] += 1
        self._stats["last_error"] = str(err)
        n = self._failures[version] = self._failures.get(version, 0) + 1
        log.warning("weights v%d rejected (%s); keeping v%d", version, err, self.version)
        if n <= self.max_retries:
            self.request_latest()

    def _fetch(self, header: WeightHeader, locator: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        self._offer = None
        t0 = time.perf_counter()
        try:
            arrays = self._from_shm(header, locator) if self.transport == "auto" else None
            transport = "shm"
            if arrays is None and not header.has_checksums:  # not mapped here after all, or not sealed
                self._wait_for_checksums(header.version, locator.get("publisher"))
                return None
            if arrays is None:
                arrays, transport = self._from_socket(header), "tcp"
        except WeightMessageError as e:
            self._reject(header.version, e)
            return None
        except _Gone:
            self._stats["gone"] += 1
            self.request_latest()
            return None
        self.version, self._source = header.version, locator.get("publisher")
        if self._offer is not None:  # announced again during the fetch (a NEED's answer): already held?
            v, by = self._offer[0].version, self._offer[1].get("publisher")
            self._offer = None if by == self._source and v <= self.version else self._offer
        self._stats.update(
            received=self._stats["received"] + 1, transport=transport, bytes=header.total_bytes
        )
        self._stats["unhashed"] += not header.has_checksums
        self._stats["fetch_s"] = time.perf_counter() - t0
        return header.version, arrays

    # ---- transports ------------------------------------------------------------------------------------
    def _from_shm(self, header: WeightHeader, locator: dict[str, Any]) -> dict[str, Any] | None:
        """The publisher's memfd mapped copy-on-write and checked in place; None when it is not reachable (or,
        for a header without checksums, not sealed or `verify_sealed`)."""
        path = locator.get("proc")
        if not isinstance(path, str) or not path.startswith("/proc/"):
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None  # another host or container, or already retired: use the socket
        memfd: SealedMemfd | None = None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (locator.get("dev"), locator.get("ino")):
                return None  # the descriptor number now names another file
            if st.st_size != header.total_bytes:
                raise WeightMessageError(
                    f"v{header.version}: payload holds {st.st_size} bytes, header says "
                    f"{header.total_bytes} (truncated?)"
                )
            try:
                # Sealed against writes and resizes (kernel-enforced) right after the publisher's copy: these
                # bytes cannot differ from the ones it wrote (and hashes, if asked): hashing proves nothing.
                sealed = is_sealed(fd)
                trusted = sealed and not self.verify_sealed
                if not (trusted or header.has_checksums):
                    return None  # nothing to check it against: wait for the announcement with checksums
                buf = mmap.mmap(fd, header.total_bytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError:
                return None  # cannot map it here: use the socket
            prefault(buf)
            # A sealed memfd stays open here with the version: a vLLM sampler's workers map it themselves.
            memfd = SealedMemfd(fd, header.total_bytes, header.tensors) if sealed else None
        finally:
            if memfd is None:
                os.close(fd)
        asm = WeightAssembler(header, buf)
        try:
            asm.verify_buffer(self._pool.map if self._pool is not None else map, trusted=trusted)
        except WeightMessageError:
            if memfd is not None:
                memfd.close()
            raise
        self._stats["verified"] = "sealed" if trusted else "checksums"
        out = ReceivedWeights(asm.finish(self.bfloat16), header.meta)
        out.memfd = memfd
        return out

    def _from_socket(self, header: WeightHeader) -> dict[str, Any]:
        """Pull every chunk with up to `window` GETs in flight; each chunk is checked on arrival."""
        v, n = header.version, header.num_chunks
        self._tag = (self._tag + 1) & 0xFFFFFFFF  # chunks of an earlier, abandoned fetch are ignored
        asm = WeightAssembler(header)
        sent = inflight = 0
        deadline = time.monotonic() + self.fetch_timeout_s
        while not asm.complete:
            unsent = False
            while inflight < self.window and sent < n and not unsent:
                unsent = not self._send([GET, META.pack(v, sent, self._tag)])
                sent, inflight = sent + (not unsent), inflight + (not unsent)
            left = deadline - time.monotonic()
            # a GET that could not be sent (no peer at the moment) is sent again soon, until the deadline
            if left <= 0 or not self._sock.poll(int(min(left, 0.05 if unsent else left) * 1000) + 1):
                if unsent and left > 0:
                    continue
                raise WeightMessageError(f"v{v}: timed out with chunks {asm.missing[:8]} of {n} missing")
            frames = self._sock.recv_multipart(copy=False)
            kind = frames[0].bytes
            meta = frames[1].bytes if len(frames) > 1 else b""
            if kind not in (CHUNK, GONE) or len(meta) != META.size:
                self._on_message([f.bytes for f in frames])
                continue
            mv, index, tag = META.unpack(meta)
            if (mv, tag) != (v, self._tag):
                continue  # stale
            if kind == GONE:
                raise _Gone
            if len(frames) != 3:
                raise WeightMessageError(f"v{v}: chunk {index} message has {len(frames)} frames, expected 3")
            asm.add_chunk(frames[2].buffer, index)
            inflight -= 1
        self._stats["verified"] = "checksums"
        return asm.finish(self.bfloat16)
