"""The one place `ray.remote` is applied and an actor's method called (`.remote`): every role runs on Ray in
a `RoleHost`, an actor that builds the role object in its own process and forwards to it the methods of the
role's Protocol (system/roles.py) and nothing else; the handle the runtime holds is a `Handle[Protocol]`,
whose calls name a Protocol method, so a call the Protocol does not declare cannot be written (mypy) nor made
(the host has no such method).

    SamplerActor = host_class("SamplerActor", SamplerRole, sampler_on_ray)       # runtime/builder.py
    handle = start_actor(SamplerActor, SamplerRole, RoleLog(run_dir, "sampler", 2), {"num_cpus": 1}, *args)
    ray.get(handle.call(SamplerRole.sample_and_commit, 4))   # TreeSampler.sample_and_commit, in the actor
    ray.get(handle.host(HostRole.pid))                       # the host's own: pid, actor_id, ping

What the host adds, written once for every role: the role's log file (RUN_DIR/logs/<role>-<i>.log, set up
before the role is built, so its construction logs there too), the process id, Ray's actor id, and what
RLlib's FaultTolerantActorManager asks of a sampler (`ping`, `apply`: an exception reaches the caller, the
process lives on). The host class is named after the role (`SamplerActor`, ...): Ray's listings and process
titles show it, and the fault drills find the role's processes by it (faults/processes.py).

Why a holder and not a subclass: Ray makes any class with an `async def` method an asyncio actor, whose sync
methods then run on a live event loop; a host forwards through sync methods only.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import ray

from storage.role_log import setup_role_log
from system.roles import HostRole

R = TypeVar("R")
P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class RoleLog:
    """Where a hosted role logs: RUN_DIR/logs/<role>-<index>.log (None: Ray's own worker log)."""

    run_dir: str
    role: str
    index: int = 0


def declared(protocol: type, method: Callable[..., Any]) -> str:
    """The name of `method` when it is `protocol`'s own (declared there or in a Protocol it extends)."""
    name = getattr(method, "__name__", "")
    if name.startswith("_") or getattr(protocol, name, None) is not method:
        raise TypeError(f"{name or repr(method)} is not a method of {protocol.__name__}")
    return name


def protocol_methods(protocol: type) -> list[str]:
    """The public methods `protocol` declares, its Protocol bases' included."""
    return [n for n, f in inspect.getmembers(protocol, inspect.isfunction) if not n.startswith("_")]


class Handle(Generic[R]):
    """A Ray actor handle typed by its role's Protocol `R`: `call(R.method, *args)`, the only way to call."""

    def __init__(self, actor: Any, role: type[R]) -> None:
        self.actor, self.role = actor, role

    def call(
        self, method: Callable[Concatenate[R, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> ray.ObjectRef[T]:
        return getattr(self.actor, declared(self.role, method)).remote(*args, **kwargs)  # type: ignore[no-any-return]

    def host(
        self, method: Callable[Concatenate[HostRole, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> ray.ObjectRef[T]:
        return getattr(self.actor, declared(HostRole, method)).remote(*args, **kwargs)  # type: ignore[no-any-return]


class RoleHost:
    """A role object in a Ray actor; `host_class` makes one class per role with its Protocol forwarded."""

    build: Callable[..., Any]

    def __init__(self, log: RoleLog | None, *args: Any, **kwargs: Any) -> None:
        if log is not None:
            setup_role_log(log.run_dir, log.role, log.index)
        self.role = type(self).build(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def actor_id(self) -> str:
        """This actor's id (hex), for Ray's public state API (restart counts: runtime/fault_tolerance.py)."""
        return str(ray.get_runtime_context().get_actor_id())

    def ping(self) -> str:
        """RLlib's health probe (FaultTolerantActorManager.probe_unhealthy_actors)."""
        return "pong"

    def apply(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """How RLlib's manager calls a method by name: an exception reaches the caller (RLlib's own
        FaultAwareApply exits the process), and the decision is the runtime's (runtime/decisions.py)."""
        return func(self, *args, **kwargs)


def _forward(name: str) -> Callable[..., Any]:
    def method(self: RoleHost, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


def host_class(name: str, protocol: type, build: Callable[..., Any]) -> type[RoleHost]:
    """A `RoleHost` class called `name` whose actors build their role with `build(*args, **kwargs)` and
    forward to it exactly the methods `protocol` declares."""
    taken = set(dir(RoleHost))
    clash = taken & set(protocol_methods(protocol))
    if clash:
        raise TypeError(f"{protocol.__name__} declares what every host answers itself: {sorted(clash)}")
    methods = {n: _forward(n) for n in protocol_methods(protocol)}
    namespace = {
        "build": staticmethod(build),
        "__module__": build.__module__,
        "__qualname__": name,
        **methods,
    }
    return type(name, (RoleHost,), namespace)


def start_actor(
    host: type[RoleHost],
    role: type[R],
    log: RoleLog | None,
    options: dict[str, Any],
    *args: Any,
    **kwargs: Any,
) -> Handle[R]:
    """A new actor of `host` with Ray `options` (resources, restarts, name, scheduling): its typed handle."""
    return Handle(ray.remote(host).options(**options).remote(log, *args, **kwargs), role)


def run_remote(function: Callable[..., T], options: dict[str, Any], *args: Any) -> T:
    """`function(*args)` as a Ray task with `options`; returns its result."""
    return ray.get(ray.remote(function).options(**options).remote(*args))  # type: ignore[no-any-return]
