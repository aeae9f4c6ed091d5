"""Graceful interrupts of `treeopsd train` (and `treeopsd soak`): the first SIGINT/SIGTERM asks for a stop,
a second one stops at once.

    with GracefulStop() as stop:           # installed after ray.init (Ray's own SIGTERM handler is replaced)
        driver = Driver(cfg, topo, sink, bar, stop)    # runtime/ray_run.py
        driver.run(steps)                  # returns after the tick in which the signal came
        driver.finish(summary)             # the in-flight learner step ends, its metrics logged; final
        ...stop_topology                   # checkpoint; every role stopped

First signal: nothing new starts; the learner's step in flight runs to its end (a step waiting for a batch
returns within a tick), then the final checkpoint is written (weights, optimizer, RNG, the store watermark =
the batches trained), the samplers stop after their current call (`stop_topology`), and `treeopsd train`
prints the step reached and the resume command and exits 0. Second signal (or the step does not end within
`finish_s`): `Abort` is raised wherever the driver is, the Ray actors are killed at once and the exit code is
128 + the signal number (130 for SIGINT, 143 for SIGTERM). Nothing is corrupted either way: every file
another process reads is written atomically (store commits, consumed log records, checkpoints), so an
abandoned step is only recomputed: `--resume` starts from the newest checkpoint and rewinds the store to its
watermark.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Abort(BaseException):
    """A second interrupt: stop at once. A BaseException, so `except Exception` on the way does not eat it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped at once by a second {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class GracefulStop:
    """Context manager: records the first SIGINT/SIGTERM, raises `Abort` on the second; restores the previous
    handlers on exit. Outside the main thread (signals only reach it) it does nothing."""

    def __init__(self, stream: Any = None) -> None:
        self.signum: int | None = None
        self.stream = stream if stream is not None else sys.stderr
        self._old: dict[int, Any] = {}

    def requested(self) -> bool:
        return self.signum is not None

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise Abort(signum)
        self.signum = signum
        name = signal.Signals(signum).name
        print(
            f"\ntreeopsd: {name}: stopping after the current learner step, then a checkpoint "
            f"(send it again to stop at once)",
            file=self.stream,
            flush=True,
        )

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
