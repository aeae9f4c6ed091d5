"""The small role interfaces the system is wired through (Acme-style: a few methods each).

The same objects run in one process (`launch/local_run.py`, tests) or as Ray actors (`launch/ray_run.py`);
only the wiring differs. Trees cross process boundaries as Arrow IPC buffers, never as pickled objects.

    sampler.sample(n)            -> trees            (pushes them with store.put_raw)
    backup.run_once()            -> credited count   (store.take_raw → credit → store.put_credited)
    learner.step(trees)          -> metrics          (then weights.publish(named, version))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from system.tree import RolloutTree


class ReplayStore(Protocol):
    """Durable tree store: raw → credited → consumed; hands out every credited tree exactly once."""

    def put_raw(self, trees: Sequence[RolloutTree]) -> Any: ...

    def take_raw(self, max_trees: int) -> list[RolloutTree]: ...

    def put_credited(self, trees: Sequence[RolloutTree]) -> Any: ...

    def take_batch(self, n: int) -> list[RolloutTree] | None: ...

    def stats(self) -> dict[str, Any]: ...


class MetricsSink(Protocol):
    """Receives `role/quantity` scalars at a step."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class WeightSource(Protocol):
    """Where the learner puts new weights (ZeroMQ `WeightPublisher`, or `InMemoryWeightChannel` in tests).

    Usage: ``source.publish(model.state_dict(), version=step)``. The source snapshots the tensors before it
    returns, so the caller may keep training them in place. Encoding: `system/weight_codec.py`.
    """

    def publish(self, named_tensors: Mapping[str, Any], version: int) -> None: ...


class WeightSink(Protocol):
    """Where a sampler picks weights up between turns: only complete, verified versions newer than the last
    one returned (`WeightSubscriber`, or the in-memory twin).

    Usage::

        got = sink.poll(timeout_ms=0)
        if got is not None:
            backend.load_weights(got[1], version=got[0])
    """

    def poll(self, timeout_ms: int = 0) -> tuple[int, dict[str, Any]] | None: ...
