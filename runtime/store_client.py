"""The one retry policy for calls on the store actor, for every caller that is not the store itself, and the
runtime's one line for an error (`one_line`).

    store = StoreLink(handle, on_lost=ft_store_lost)    # the driver's: waits for Ray's restart, tries again
    store.call(StoreRole.stats)                         # any store method, through the same policy
    StoreLink(handle, on_lost=store_unavailable)        # a sampler's: its call ends, the sampler lives on

Ray restarts a dead store in place (`run.max_store_restarts`); a call in flight at the death, or made while it
restarts, fails with a `RayActorError`, is handed to `on_lost` (which waits for the store, or raises) and is
made once more (docs/design.md §14, "The store").
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import ray

from runtime.remote import Handle
from storage.replay_store_actor import RemoteStore
from system.interfaces import StoreUnavailable
from system.roles import HostRole, StoreRole

STORE_DOWN_BACKOFF_S = 0.5  # before a sampler's call returns: its next one does not spin while Ray restarts
STORE_WAIT_S = 600.0  # a restarted store reopens its directory first: that scans every segment


class StoreGone(RuntimeError):
    """The store does not answer, and Ray will not bring it back (its restarts are used up)."""


class StoreLink(RemoteStore):
    """`RemoteStore` whose calls survive a store restart (module docstring): a lost store is handed to
    `on_lost`, then the call is made once more."""

    def __init__(self, handle: Handle[StoreRole], on_lost: Callable[[BaseException], None]) -> None:
        super().__init__(handle)
        self.on_lost = on_lost

    def _call(self, method: Any, *args: Any) -> Any:
        try:
            return super()._call(method, *args)
        except ray.exceptions.RayActorError as e:  # the store actor: the only actor its clients call
            self.on_lost(e)
        return super()._call(method, *args)

    def call(self, method: Callable[..., Any], *args: Any) -> Any:
        """Any `StoreRole` method (`StoreRole.stats`, ...), under the same policy."""
        return self._call(method, *args)


def store_unavailable(error: BaseException) -> None:
    """A sampler's `on_lost`: back off, then end the call (`TreeSampler.sample_and_commit` returns)."""
    time.sleep(STORE_DOWN_BACKOFF_S)
    raise StoreUnavailable(one_line(error)) from error


def store_pid(handle: Handle[StoreRole], timeout_s: float = STORE_WAIT_S) -> tuple[int, str]:
    """(the store's pid once it answers, the first "unavailable" error seen meanwhile, or ""): a store being
    restarted answers "unavailable" until it has reopened its directory. `StoreGone` when it is dead for good
    or does not answer within `timeout_s`."""
    deadline, seen = time.monotonic() + timeout_s, ""
    while True:
        left = deadline - time.monotonic()
        try:
            return int(ray.get(handle.host(HostRole.pid), timeout=max(left, 0.1))), seen
        except ray.exceptions.ActorUnavailableError as e:  # restarting: ask again
            seen = seen or one_line(e)
            if left > 0:
                time.sleep(0.5)
                continue
            raise StoreGone(f"unavailable for {timeout_s:.0f} s") from None
        except ray.exceptions.GetTimeoutError:
            raise StoreGone(f"no answer within {timeout_s:.0f} s") from None
        except ray.exceptions.RayActorError as e:  # dead for good: Ray's restarts are used up
            raise StoreGone(seen or one_line(e)) from None


def one_line(e: BaseException, limit: int = 300) -> str:
    """One line for a failure: the exception type and its message (a task error's cause), Ray's death notice
    cut to its exit type, a collective's source location (`[../gloo/...] `) dropped."""
    cause = getattr(e, "cause", None) or e
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(cause).split()))
    kind = re.search(r"Worker exit type: (\w+)", text)
    if kind and not isinstance(e, ray.exceptions.RayTaskError):
        text = f"its worker process exited ({kind.group(1)})"
    return f"{type(cause).__name__}: {text}"[:limit]
