"""Where the asynchronous agent loop takes new weights: at a turn boundary, with every episode paused there
for as short as possible, and every turn sampled by exactly one version.

    poller = WeightPoller(sink)                      # the sink polled from one worker thread
    gate = WeightGate(server, poller, stats)
    version = await gate.turn_started()              # before each turn: waits while a load is due
    ... await server.generate_turn(req) ...
    gate.turn_ended()

`load_version` is the one place a sampler's weights change: the gate calls it between turns, and the
sampler (actors/tree_sampler.py:catch_up) before a call and between the lockstep loop's rounds.

A version that arrives is first checked and staged where the server can do that ahead (vLLM's
`prepare_weights`, in a worker thread while turns still run), then it closes the gate: no new turn starts,
the turns being generated run to their end (each keeps the version it started with), then the version is
loaded in place (`server.apply_weights`) and the gate opens; the turns started after carry the new
version. Episodes between turns (running a tool call) go on meanwhile. `sampler/paused_for_weights_s`
adds up the time the gate was closed (the drain plus the load), `weights/apply_s` is the last load alone.

Why a thread for polling: a fetch over a socket can take seconds and the subscriber's socket wants one
thread; the event loop never blocks on it. A poll still running when a round ends is kept and its answer
taken by the next poll (of the next round, or `poll()` between rounds): no version is lost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

from system.interfaces import WeightSink
from system.policy import TurnServer

Got = tuple[int, dict[str, Any]] | None


async def load_version(server: TurnServer, version: int, tensors: Any, stats: dict[str, float]) -> None:
    """Loads `version` in place (`server.apply_weights`), timed (`weights/apply_s`, the last load) and
    counted (`weights/applied`). Callers make sure no turn is being generated meanwhile."""
    t0 = time.perf_counter()
    await server.apply_weights(tensors, version)
    stats["weights/apply_s"] = time.perf_counter() - t0
    stats["weights/applied"] = stats.get("weights/applied", 0.0) + 1.0


class WeightPoller:
    """A WeightSink polled from one worker thread; also a WeightSink itself (`poll`), for the lockstep
    loop and for waiting between rounds, so every poll of the sink happens on that thread."""

    def __init__(self, sink: WeightSink, interval_ms: int = 50) -> None:
        self.sink, self.interval_ms = sink, interval_ms
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights-poll")
        self._fut: concurrent.futures.Future[Got] | None = None

    def _start(self, timeout_ms: int) -> concurrent.futures.Future[Got]:
        if self._fut is None or self._fut.cancelled():
            self._fut = self._pool.submit(self.sink.poll, timeout_ms)
        return self._fut

    def _take(self, fut: concurrent.futures.Future[Got]) -> Got:
        if self._fut is fut:
            self._fut = None
        return fut.result()

    def start_poll(self, timeout_ms: int) -> concurrent.futures.Future[Got]:
        """The poll in flight, or a new one; `taken()` once its answer is used."""
        return self._start(timeout_ms)

    def taken(self) -> None:
        if self._fut is not None and self._fut.done():
            self._fut = None

    def poll(self, timeout_ms: int = 0) -> Got:
        """A blocking poll through the worker thread (one already running is waited for and taken)."""
        return self._take(self._start(timeout_ms))

    async def next_version(self) -> tuple[int, dict[str, Any]]:
        """Waits for the next version (polling every `interval_ms`)."""
        while True:
            fut = self._start(self.interval_ms)
            await asyncio.wrap_future(fut)
            got = self._take(fut)
            if got is not None:
                return got

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class WeightGate:
    """The turn boundaries of every episode in flight, and the one place weights change (see above)."""

    def __init__(self, server: TurnServer, poller: WeightPoller | None, stats: dict[str, float]) -> None:
        self.server, self.poller, self.stats = server, poller, stats
        self.generating = 0  # turns being generated now
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.due = asyncio.Event()  # set while a version waits for the turns in flight (tests wait on it)
        self._watch: asyncio.Task[None] | None = None
        self._applying: asyncio.Task[None] | None = None

    async def turn_started(self) -> int:
        """Call before a turn; returns the policy version the turn is sampled with."""
        while not self._open.is_set():
            await self._open.wait()
        self.generating += 1
        self._idle.clear()
        return int(self.server.version)

    def turn_ended(self) -> None:
        self.generating -= 1
        if self.generating == 0:
            self._idle.set()

    async def catch_up(self) -> None:
        """Takes a version that is waiting already, before any turn starts: the first turns get it.

        The gate closes before the first await, so episode tasks created before this call (an
        `asyncio.gather` runs none of them until its caller yields) wait at `turn_started` until the poll
        has answered and any load is done."""
        if self.poller is None:
            return
        self._open.clear()
        try:
            got = await asyncio.wrap_future(self.poller.start_poll(0))
            self.poller.taken()
            if got is not None and got[0] > self.server.version:
                await self.apply(*got)
        finally:
            self._open.set()

    def start(self) -> asyncio.Task[None] | None:
        """Starts watching for versions (nothing without a poller); the task fails if a load fails."""
        if self.poller is not None:
            self._watch = asyncio.get_running_loop().create_task(self._run())
        return self._watch

    async def _run(self) -> None:
        assert self.poller is not None
        while True:
            version, tensors = await self.poller.next_version()
            if version > self.server.version:
                self._applying = asyncio.ensure_future(self.apply(version, tensors))
                await asyncio.shield(self._applying)  # stop() never cuts a load in half

    async def apply(self, version: int, tensors: Any) -> None:
        # vLLM: checked and staged while turns still run, so the pause is the load (BatchedTurns: as is)
        tensors = await self.server.prepare_weights(tensors)
        t0 = time.perf_counter()
        self._open.clear()
        self.due.set()
        try:
            await self._idle.wait()
            await load_version(self.server, version, tensors, self.stats)
        finally:
            self.due.clear()
            self._open.set()
            key = "sampler/paused_for_weights_s"
            self.stats[key] = self.stats.get(key, 0.0) + time.perf_counter() - t0

    async def stop(self) -> None:
        """Stops watching; a load under way finishes first."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self._applying is not None and not self._applying.done():
            await self._applying
        # A cancelled task keeps its CancelledError, whose traceback keeps the task's frame, which keeps
        # this gate (and, had it a version in hand, that version's tensors: a mapped payload). The gate
        # holding the task closes a cycle only the cyclic collector frees, rarely in a long-lived actor:
        # one payload mapping kept per round, the sampler's memory growing by that (soak, 2.3 MB/min).
        self._watch = self._applying = None
