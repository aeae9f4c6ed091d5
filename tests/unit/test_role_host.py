"""runtime/remote.py's host: a class per role that builds the role object in its process and forwards to it
the methods of the role's Protocol, and no others; what the host adds (pid, ping, the role log) is its own.
Checked without Ray: the host class is a plain class until `start_actor` hands it to `ray.remote`."""

import functools
import logging
import os
from typing import Protocol

import pytest

from runtime import remote
from runtime.remote import Handle, RoleHost, RoleLog, declared, host_class
from storage import role_log


class Counter:
    def __init__(self, start: int) -> None:
        self.n = start

    def add(self, k: int = 1) -> int:
        self.n += k
        return self.n

    def pid(self) -> int:  # the host's own pid() wins over a role method of that name
        return -1

    def _private(self) -> None:
        raise AssertionError("never forwarded")


class CounterRole(Protocol):
    def add(self, k: int = 1) -> int: ...


def build_counter(start: int, step: int = 0) -> Counter:
    return Counter(start + step)


def test_the_host_builds_its_role_and_forwards_only_its_protocol_s_methods(tmp_path):
    Host = host_class("CounterActor", CounterRole, build_counter)
    assert Host.__name__ == "CounterActor" and issubclass(Host, RoleHost)
    host = Host(None, 5, step=2)  # build_counter(5, step=2): Counter(7)
    assert host.add() == 8 and host.add(k=2) == 10  # 7 + 1, then 8 + 2
    assert host.role.n == 10
    assert host.pid() == os.getpid()  # the host's, not Counter.pid's -1
    assert host.ping() == "pong"  # RLlib's health probe, answered by the host
    assert not hasattr(Host, "_private") and not hasattr(Host, "n")


def test_a_protocol_that_declares_a_host_method_is_refused():
    class Clashing(Protocol):
        def pid(self) -> int: ...

    with pytest.raises(TypeError, match=r"declares what every host answers itself: \['pid'\]"):
        host_class("ClashActor", Clashing, build_counter)


def test_a_handle_calls_only_its_protocol_s_methods():
    class Actor:  # stands for a Ray actor handle: `.add.remote(...)`
        class add:
            @staticmethod
            def remote(k=1):
                return ("ref", k)

    handle = Handle(Actor(), CounterRole)
    assert handle.call(CounterRole.add, 3) == ("ref", 3)
    assert declared(CounterRole, CounterRole.add) == "add"
    with pytest.raises(TypeError, match="is not a method of CounterRole"):
        handle.call(Counter.add, 3)  # the role class's method, not the Protocol's
    with pytest.raises(TypeError, match="_private is not a method of CounterRole"):
        declared(CounterRole, Counter._private)


def test_the_host_sets_up_the_role_log_before_building(tmp_path, monkeypatch):
    # the real setup, but this test process keeps its own stderr (an actor's goes to the file)
    keep_stderr = functools.partial(role_log.setup_role_log, redirect_stderr=False)
    monkeypatch.setattr(remote, "setup_role_log", keep_stderr)
    before = list(logging.getLogger().handlers)
    try:
        remote.host_class("CounterActor", CounterRole, build_counter)(RoleLog(str(tmp_path), "counter", 3), 0)
    finally:
        for handler in set(logging.getLogger().handlers) - set(before):
            logging.getLogger().removeHandler(handler)
            handler.close()
    log = tmp_path / "logs" / "counter-3.log"
    assert "counter-3 started" in log.read_text()
