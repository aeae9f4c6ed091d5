"""The small interfaces the roles talk through (Acme-style: a few methods each), and which objects meet them.

The same role classes, built by one builder (`runtime/builder.py`), run in one process (`runtime/local.py`,
tests) or as Ray actors (`runtime/roles.py` starts them); only the objects behind these interfaces differ:

    interface     in one process                                 on Ray
    StoreClient   storage.replay_store.ReplayStore               storage.replay_store_actor.RemoteStore
    WeightSource  system.weight_channel.InMemoryWeightChannel    learner.weight_publisher.WeightPublisher
    WeightSink    InMemoryWeightChannel.sink()                   actors.weight_subscriber.WeightSubscriber
    MetricsSink   storage.metrics.MemorySink (tests)             storage.metrics.TensorboardSink (NullSink
                                                                 with logging.tensorboard = false)

The roles: `actors.tree_sampler.TreeSampler.sample_and_commit` (admit → sample trees → put_raw),
`actors.backup_worker.BackupWorker.run_once` (lease_raw → credit → put_credited) and
`learner.learner.Learner.train_step` (take_batch → train → publish → checkpoint). Trees cross process
boundaries as Arrow IPC bytes, never as pickled objects (`RemoteStore` encodes and decodes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from system.tree import RolloutTree


class StoreUnavailable(RuntimeError):
    """The store cannot be reached right now (a store actor being restarted); the caller's call ends, the
    caller itself goes on (the sampler: `TreeSampler.sample_and_commit`)."""


class StoreClient(Protocol):
    """The durable tree store as the roles see it: raw → credited → consumed, each credited tree handed out
    exactly once. Samplers: admit, put_raw, release. Backup: lease_raw, put_credited. Learner: take_batch,
    watermark, set_learner_version, rewind_to (on resume), limit_lag (staleness bounded by drift)."""

    def put_raw(self, trees: Sequence[RolloutTree]) -> int: ...

    def lease_raw(self, max_trees: int) -> list[RolloutTree]: ...

    def put_credited(self, trees: Sequence[RolloutTree]) -> int: ...

    def take_batch(self, n: int) -> list[RolloutTree] | None: ...

    def admit(self, n: int) -> int: ...

    def release(self, n: int) -> None: ...

    def watermark(self) -> int: ...

    def rewind_to(self, watermark: int) -> int: ...

    def set_learner_version(self, version: int) -> None: ...

    def limit_lag(self, lag: int | None) -> None: ...


class MetricsSink(Protocol):
    """Receives `role/quantity` scalars (and histograms) at a step; `flush` makes them visible to readers."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def histogram(self, key: str, values: Sequence[float], step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class WeightSource(Protocol):
    """Where the learner puts new weights. Usage: ``source.publish(model.state_dict(), version=step)``. The
    source snapshots the tensors before it returns, so the caller may keep training them in place."""

    def publish(self, named_tensors: Mapping[str, Any], version: int) -> None: ...


class WeightSink(Protocol):
    """Where a sampler picks weights up between turns: only complete, verified versions newer than the last
    one returned. Usage (actors/tree_sampler.py `TreeSampler.catch_up`)::

        got = sink.poll(timeout_ms=0)
        if got is not None:
            backend.load_weights(got[1], version=got[0])
    """

    def poll(self, timeout_ms: int = 0) -> tuple[int, dict[str, Any]] | None: ...
