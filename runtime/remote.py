"""The one place `ray.remote` is applied: every role runs on Ray inside a `RoleHost`, an actor that builds
the role object in its own process and forwards calls to it. The roles stay plain classes (`TreeSampler`,
`BackupWorker`, `Learner`, `ReplayStore`, ...): nothing of Ray in them, and the same objects run in one
process (runtime/local.py).

    SamplerActor = host_class("SamplerActor", TreeSampler, build_sampler, FaultAwareApply)
    handle = start_actor(SamplerActor, RoleLog(run_dir, "sampler", 2), {"num_cpus": 1}, *build_args)
    ray.get(handle.sample_and_commit.remote(4))        # TreeSampler.sample_and_commit, in the actor
    ray.get(handle.pid.remote())                       # the host's own: pid, actor_id

What the host adds, written once for every role: the role's log file (RUN_DIR/logs/<role>-<i>.log, set up
before the role is built, so its construction logs there too), the process id and Ray's actor id. The host
class is named after the role (`SamplerActor`, ...): Ray's listings and process titles (`ray::SamplerActor`)
show it, and the fault drills find the role's processes by it (faults/processes.py).

Why a holder and not a subclass: Ray makes any class with an `async def` method an asyncio actor, whose
sync methods then run on a live event loop; a host forwards through sync methods only, so a role may
have coroutines of its own. And a role's constructor arguments stay the role's: the host's are the log and
the build arguments.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from storage.role_log import setup_role_log


@dataclass(frozen=True)
class RoleLog:
    """Where a hosted role logs: RUN_DIR/logs/<role>-<index>.log (None: Ray's own worker log)."""

    run_dir: str
    role: str
    index: int = 0


class RoleHost:
    """A role object in a Ray actor; `host_class` makes one class per role with its methods forwarded."""

    build: Callable[..., Any]

    def __init__(self, log: RoleLog | None, *args: Any, **kwargs: Any) -> None:
        if log is not None:
            setup_role_log(log.run_dir, log.role, log.index)
        self.role = type(self).build(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def actor_id(self) -> str:
        """This actor's id (hex), for Ray's public state API (restart counts: runtime/supervision.py)."""
        return str(ray.get_runtime_context().get_actor_id())


def _forward(name: str) -> Callable[..., Any]:
    def method(self: RoleHost, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


def host_class(name: str, role: type, build: Callable[..., Any], *mixins: type) -> type[RoleHost]:
    """A `RoleHost` class called `name` whose actors build their role with `build(*args, **kwargs)` and
    forward every public method of `role` to it (`mixins`: host-side behaviour, e.g. RLlib's
    FaultAwareApply for the sampler manager's health probes)."""
    bases = (*mixins, RoleHost)
    taken = {n for base in bases for n in dir(base)}
    methods = {
        n: _forward(n)
        for n in dir(role)
        if not n.startswith("_") and n not in taken and callable(getattr(role, n, None))
    }
    namespace = {
        "build": staticmethod(build),
        "__module__": build.__module__,
        "__qualname__": name,
        **methods,
    }
    return type(name, bases, namespace)


def start_actor(
    host: type[RoleHost], log: RoleLog | None, options: dict[str, Any], *args: Any, **kwargs: Any
) -> Any:
    """A new actor of `host` with Ray `options` (resources, restarts, name, scheduling): its handle."""
    return ray.remote(host).options(**options).remote(log, *args, **kwargs)


def run_remote(function: Callable[..., Any], options: dict[str, Any], *args: Any) -> Any:
    """`function(*args)` as a Ray task with `options`; returns its result."""
    return ray.get(ray.remote(function).options(**options).remote(*args))
