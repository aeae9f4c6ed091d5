"""The roles' contracts: per role, every method the runtime or another role calls on it, declared once.

On Ray each role runs inside a host actor that forwards exactly the methods of its Protocol here
(runtime/remote.py:host_class), and the runtime holds the actor as a `Handle[Protocol]` whose only call is
`handle.call(Protocol.method, *args)`: a method no Protocol declares cannot be written (mypy strict checks
runtime/) nor reached (the host has no such method). `tests/unit/test_role_protocols.py` holds the role
classes to their Protocols' signatures and checks that no code calls an actor any other way.

    role          class (the object behind the handle)        called by
    SamplerRole   actors.tree_sampler.TreeSampler             Roles (the sampler pool), external trees
    StoreRole     storage.replay_store.ReplayStore            the driver, the fault tolerance; RemoteStore
    BackupRole    actors.backup_worker.BackupWorker           the driver
    LearnerRole   learner.learner.Learner (rank 0 and others) the driver, LearnerGroup, the fault tolerance
    RetrievalRole runtime.retrieval_actor.RetrievalService    Roles (start, stop), the fault tolerance
    HostRole      runtime.remote.RoleHost (every role's host) the fault tolerance, RLlib's manager

The policy backends' contracts are `system.policy.PolicyBackend` and `TurnServer`. Types that live above
this layer (trees, tasks, turn servers of the actors) appear as `Any`: system/ imports nothing above it.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar, runtime_checkable

from system.interfaces import StoreClient
from system.policy import TurnServer

T = TypeVar("T")


class SamplerRole(Protocol):
    """A sampler: admitted prompts in, trees committed to the store."""

    def sample_and_commit(self, n: int, min_version: int = 0, wait_s: float = 60.0) -> dict[str, Any]:
        """Samples up to n admitted trees and commits them; counts and the metrics snapshot back."""
        ...

    def catch_up(self, min_version: int = 0, wait_s: float = 0.0) -> None: ...

    def version(self) -> int: ...

    def get_metrics(self) -> dict[str, float]: ...

    def turn_server(self) -> TurnServer:
        """The backend as the asynchronous loops see it (the sampler's own, external trees')."""
        ...

    def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine over `turn_server()` on the event loop it needs (vLLM: the engine's)."""
        ...

    def close(self) -> None: ...


class StoreRole(StoreClient, Protocol):
    """The replay store itself: the StoreClient methods, the Arrow IPC twins a RemoteStore calls (trees
    cross processes as bytes), and what the driver asks of it."""

    def lease_raw_ipc(self, max_trees: int) -> bytes: ...

    def take_batch_ipc(self, n: int) -> bytes | None: ...

    def stats(self) -> dict[str, Any]: ...

    def tree_ids(self, state: str | None = None) -> list[str]: ...

    def close(self) -> None: ...


class BackupRole(Protocol):
    """The backup: leased raw trees in, credited trees out."""

    def run_once(self, max_trees: int = 64, idle_sleep_s: float = 0.0) -> int: ...

    def get_metrics(self) -> dict[str, float]: ...


class LearnerRole(Protocol):
    """A learner rank (the driver and the samplers talk to rank 0; `LearnerGroup.call` reaches all)."""

    def train_step(self, idle_sleep_s: float = 0.0) -> dict[str, float] | None:
        """One step on the next batch, or None while the store has none."""
        ...

    def progress(self) -> dict[str, int]: ...

    def endpoint(self) -> tuple[str, bytes | None]:
        """Where the samplers subscribe to the weights, and the key that signs them."""
        ...

    def last_step_metrics(self) -> dict[str, float] | None: ...

    def pop_lags(self) -> list[int]: ...

    def save_final(self) -> str: ...

    def stop(self) -> None: ...


class RetrievalRole(Protocol):
    """The retrieval service's actor: the URL the samplers search, its health check (`describe`), stopped at
    the end of the run."""

    def url(self) -> str: ...

    def describe(self) -> dict[str, Any]: ...

    def stop(self) -> None: ...


class HostRole(Protocol):
    """What every role's host actor answers itself (runtime/remote.py:RoleHost), whatever its role."""

    def pid(self) -> int: ...

    def actor_id(self) -> str: ...

    def ping(self) -> str: ...


@runtime_checkable
class Counters(Protocol):
    """An object with counters for the metrics (the weight subscriber: `weights/rejected`, ...)."""

    def metrics(self) -> dict[str, float]: ...


@runtime_checkable
class Closeable(Protocol):
    """An object holding something to give back at the end (the weight subscriber: its socket)."""

    def close(self) -> None: ...


# The Protocol of each role name the runtime's call sites use (tests/unit/test_role_protocols.py).
ROLES: dict[str, type] = {
    "sampler": SamplerRole,
    "store": StoreRole,
    "backup": BackupRole,
    "learner": LearnerRole,
    "retrieval": RetrievalRole,
}
