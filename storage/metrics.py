"""Metrics sinks (system/interfaces.py `MetricsSink`): tensorboard event files (the run's record), an
in-memory twin for tests, and a sink that drops everything (`logging.tensorboard = false`).

Keys are `role/quantity` (`sampler/tokens_per_s`, `learner/mb0/overshoot_frac`, ...). Non-finite values are
skipped and counted rather than written, so one NaN does not poison a curve.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import numpy as np


class TensorboardSink:
    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard import costs ~1 s

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(str(self.log_dir), flush_secs=5)
        self.skipped = 0

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            v = float(value)
            if math.isfinite(v):
                self._writer.add_scalar(key, v, step)
            else:
                self.skipped += 1

    def histogram(self, key: str, values, step: int) -> None:
        if len(values):
            self._writer.add_histogram(key, np.asarray(values, dtype=np.float64), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MemorySink:
    """Keeps every logged value: `sink.series["learner/loss"] == [(step, value), ...]`."""

    def __init__(self) -> None:
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.series[key].append((step, float(value)))

    def histogram(self, key: str, values, step: int) -> None:
        self.series[key + "/hist_mean"].append((step, float(sum(values) / max(len(values), 1))))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class NullSink:
    """Drops everything (`logging.tensorboard = false`)."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def histogram(self, key: str, values, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def read_scalars(log_dir: str | Path, purge: bool = True) -> dict[str, list[tuple[int, float]]]:
    """All scalar series from a run's event files (for reports and tests), in the order logged. `purge`:
    tensorboard's view, where a step logged again drops the later ones; False keeps every event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}, purge_orphaned_data=purge)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
