"""Wait for a condition, with a deadline, instead of sleeping for a fixed time (loaded CI machines are slow).

wait_until(lambda: pub.stats()["spare_ready"])          # fails the test after 30 s
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.01) -> T:
    """Call `pred` until it returns something true (returned), or fail after `timeout_s`. `pred` may block
    briefly itself (a poll with a timeout): `interval_s` is only a pause between tries."""
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {getattr(pred, '__qualname__', pred)}")
        time.sleep(interval_s)
    return got
