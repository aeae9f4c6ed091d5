"""The weight gate of the asynchronous agent loop (actors/weight_gate.py): a version is loaded only when no
turn is being generated, turns started after the load carry it, turns in flight keep theirs, a version
waiting before the first turn is taken first, no polled version is lost between rounds, and a failed
load fails the round. Every wait is an event with a bound; nothing sleeps."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import pytest

from actors.async_loop import EpisodeRunner
from actors.weight_gate import WeightGate, WeightPoller

BOUND_S = 30.0  # a bound on every wait: reached only when the behavior under test is broken


class FakeServer:
    """A TurnServer whose loads are recorded with the number of turns being generated at that moment."""

    def __init__(self, gate_ref: list[WeightGate] | None = None, fail: bool = False) -> None:
        self.version, self.applied, self.fail, self.prepared_with = 0, [], fail, -1
        self.gate_ref = gate_ref if gate_ref is not None else []

    async def prepare_weights(self, named_tensors: Any) -> Any:
        self.prepared_with = self.gate_ref[0].generating  # staged while turns still run
        return {**named_tensors, "staged": True}

    async def apply_weights(self, named_tensors: Any, version: int) -> None:
        if self.fail:
            raise RuntimeError("the load failed")
        in_flight = self.gate_ref[0].generating if self.gate_ref else -1
        self.applied.append((version, in_flight, dict(named_tensors)))
        self.version = version

    async def release(self, *keys: str) -> None:
        pass


class HeldSink:
    """A WeightSink whose poll returns a version once the test offers one; `entered` is set when a poll
    starts, `hold` keeps a poll from returning until the test releases it."""

    def __init__(self) -> None:
        self.offered: tuple[int, dict[str, Any]] | None = None
        self.ready, self.entered, self.hold = threading.Event(), threading.Event(), threading.Event()
        self.hold.set()

    def offer(self, version: int, tensors: dict[str, Any]) -> None:
        self.offered = (version, tensors)
        self.ready.set()

    def poll(self, timeout_ms: int = 0) -> tuple[int, dict[str, Any]] | None:
        self.entered.set()
        assert self.hold.wait(BOUND_S)
        if not self.ready.wait(timeout_ms / 1000):
            return None
        got, self.offered = self.offered, None
        self.ready.clear()
        return got


def _gate(sink: HeldSink, **kw: Any) -> tuple[WeightGate, FakeServer, dict[str, float]]:
    ref: list[WeightGate] = []
    server, stats = FakeServer(ref, **kw), {}
    gate = WeightGate(server, WeightPoller(sink, interval_ms=20), stats)
    ref.append(gate)
    return gate, server, stats


def test_a_version_is_loaded_at_the_next_turn_boundary() -> None:
    async def scenario() -> None:
        sink = HeldSink()
        gate, server, stats = _gate(sink)
        await gate.catch_up()  # nothing waiting yet
        assert server.applied == []
        gate.start()
        first = await gate.turn_started()  # turn A is being generated with version 0
        sink.offer(1, {"w": 1})
        await asyncio.wait_for(gate.due.wait(), BOUND_S)  # the version arrived: the gate is closed
        b = asyncio.ensure_future(gate.turn_started())  # turn B wants to start
        for _ in range(5):
            await asyncio.sleep(0)  # hand the loop round a few times: B and the load both stay waiting
        assert not b.done() and server.applied == []  # no load while A is being generated
        gate.turn_ended()  # A ends (it keeps version 0)
        second = await asyncio.wait_for(b, BOUND_S)
        assert (first, second) == (0, 1)
        assert server.prepared_with == 1  # staged while turn A was still being generated
        assert server.applied == [(1, 0, {"w": 1, "staged": True})]  # loaded with 0 turns in flight
        assert stats["weights/applied"] == 1.0
        assert stats["sampler/paused_for_weights_s"] >= stats["weights/apply_s"] >= 0.0
        gate.turn_ended()
        await gate.stop()
        gate.poller.close()  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_a_waiting_version_goes_before_the_first_turn() -> None:
    """Episode tasks created before `catch_up` (as asyncio.gather creates them) still get the version."""

    async def scenario() -> None:
        sink = HeldSink()
        sink.offer(3, {"w": 3})
        gate, server, _ = _gate(sink)
        turns = [asyncio.ensure_future(gate.turn_started()) for _ in range(3)]
        await gate.catch_up()
        assert await asyncio.wait_for(asyncio.gather(*turns), BOUND_S) == [3, 3, 3]
        assert [v for v, _, _ in server.applied] == [3]
        gate.poller.close()  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_a_version_polled_as_a_round_ends_goes_to_the_next_round() -> None:
    async def scenario() -> None:
        sink = HeldSink()
        sink.hold.clear()  # the watcher's poll will stay inside the sink
        gate, server, stats = _gate(sink)
        gate.start()
        assert await asyncio.to_thread(sink.entered.wait, BOUND_S)
        await gate.stop()  # the round ends with that poll still running
        sink.offer(7, {"w": 7})
        sink.hold.set()  # the poll answers after its round
        later = WeightGate(server, gate.poller, stats)
        await later.catch_up()  # the next round takes the answer of the poll left running
        assert [v for v, _, _ in server.applied] == [7]
        assert await later.turn_started() == 7
        gate.poller.close()  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_a_failed_load_fails_the_round() -> None:
    async def scenario() -> None:
        sink = HeldSink()
        gate, server, stats = _gate(sink, fail=True)
        runner = EpisodeRunner(server, None, None, None, gate, max_inflight=2, tools=None, stats=stats)  # type: ignore[arg-type]
        never = asyncio.get_running_loop().create_future()  # episodes that would run forever
        sink.offer(1, {"w": 1})
        with pytest.raises(RuntimeError, match="the load failed"):
            await asyncio.wait_for(runner.drive(never), BOUND_S)
        assert never.cancelled() and server.version == 0
        gate.poller.close()  # type: ignore[union-attr]

    asyncio.run(scenario())


class Payload:
    """Stands for a version's tensors (on a vLLM or HF sampler: buffers mapped from the publisher's memfd)."""


class LoadOnlyServer:
    """A TurnServer that keeps nothing of what it loads (FakeServer keeps every load to assert on)."""

    def __init__(self) -> None:
        self.version, self.loaded = 0, asyncio.Event()

    async def prepare_weights(self, named_tensors: Any) -> Any:
        return named_tensors  # nothing to stage

    async def apply_weights(self, named_tensors: Any, version: int) -> None:
        self.version = version
        self.loaded.set()


def test_a_round_keeps_no_reference_to_the_weights_it_loaded() -> None:
    """A version the watcher loads in the middle of a round is freed when the round ends, by reference
    counting alone: a cycle through the cancelled watcher's traceback (the gate → its task → the task's
    CancelledError → the watcher's frame → the gate) kept one mapped payload per round alive until the
    cyclic collector ran, which in a long-lived sampler is rarely (the soak's 2.3 MB/min). The collector
    is off here, so a cycle that holds the payload would keep it."""

    async def scenario() -> weakref.ref[Payload]:
        sink, server = HeldSink(), LoadOnlyServer()
        poller = WeightPoller(sink, interval_ms=20)
        gate = WeightGate(server, poller, {})  # type: ignore[arg-type]
        gate.start()
        payload = Payload()
        ref = weakref.ref(payload)
        sink.offer(1, {"w": payload})
        del payload
        await asyncio.wait_for(server.loaded.wait(), BOUND_S)  # loaded mid-round by the watcher
        await gate.stop()  # the round ends
        poller.close()
        assert server.version == 1
        return ref

    gc.collect()
    gc.disable()
    try:
        ref = asyncio.run(scenario())
        assert ref() is None
    finally:
        gc.enable()
