"""The roles' contracts (system/roles.py, system/policy.py) hold on both sides: each role and backend class
has every method of its Protocol with a signature that takes the Protocol's calls, and every method name
the runtime sends to a role (`handle.name.remote(…)`, `call("name", …)`, `foreach_actor*("name", …)`,
`store_call(step, "name", …)`, `_call("name", …)`) is declared in that role's Protocol. On Ray a call by
name reaches whatever the role has of that name, so without this nothing would catch a call the role's
Protocol (and maybe the role) lacks until a run made it."""

from __future__ import annotations

import ast
import inspect
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from actors.backup_worker import BackupWorker
from actors.envs.base import Environment, ToolEnv
from actors.policy.hf_backend import HFBackend
from actors.policy.vllm_backend import VLLMBackend
from actors.tree_sampler import TreeSampler
from actors.turn_server import BatchedTurns, as_turn_server
from actors.weight_subscriber import WeightSubscriber
from learner.learner import Learner
from runtime.remote import RoleHost
from runtime.retrieval_actor import RetrievalService
from storage.replay_store import ReplayStore
from storage.replay_store_actor import RemoteStore
from system.interfaces import StoreClient
from system.policy import PolicyBackend, TurnServer
from system.roles import (
    ROLES,
    BackupRole,
    Closeable,
    Counters,
    HostRole,
    LearnerRole,
    RetrievalRole,
    SamplerRole,
    StoreRole,
)
from tests.external_fixtures import ToolScript
from tests.fakes import ScriptedBackend

ROOT = Path(__file__).resolve().parents[2]
P = inspect.Parameter

CONFORMING: list[tuple[type, type]] = [
    (SamplerRole, TreeSampler),
    (StoreRole, ReplayStore),
    (StoreClient, RemoteStore),
    (BackupRole, BackupWorker),
    (LearnerRole, Learner),
    (RetrievalRole, RetrievalService),
    (HostRole, RoleHost),
    (PolicyBackend, HFBackend),
    (PolicyBackend, VLLMBackend),
    (PolicyBackend, ScriptedBackend),
    (PolicyBackend, ToolScript),
    (TurnServer, BatchedTurns),
    (TurnServer, VLLMBackend),
    (Environment, ToolEnv),
    (Counters, WeightSubscriber),
    (Closeable, WeightSubscriber),
]


def protocol_methods(protocol: type) -> dict[str, Any]:
    """The methods a Protocol declares, its Protocol bases' included."""
    out: dict[str, Any] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, typing.Protocol, typing.Generic) or not getattr(cls, "_is_protocol", False):
            continue
        out.update({n: f for n, f in vars(cls).items() if inspect.isfunction(f) and not n.startswith("_")})
    return out


def _positional(sig: inspect.Signature) -> list[P]:
    return [p for p in sig.parameters.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]


def incompatibilities(declared: Any, implemented: Any) -> list[str]:
    """Why `implemented` cannot take every call `declared` allows (empty: it can)."""
    why = []
    if inspect.iscoroutinefunction(declared) != inspect.iscoroutinefunction(implemented):
        why.append("one is a coroutine function, the other not")
    want, have = inspect.signature(declared), inspect.signature(implemented)
    kinds = {p.kind for p in have.parameters.values()}
    want_pos, have_pos = _positional(want)[1:], _positional(have)[1:]  # without self
    for i, p in enumerate(want_pos):
        if i >= len(have_pos):
            if P.VAR_POSITIONAL not in kinds:
                why.append(f"no positional parameter {p.name}")
            continue
        if have_pos[i].name != p.name:
            why.append(f"parameter {i + 1} is {have_pos[i].name}, not {p.name}")
        if p.default is not P.empty and have_pos[i].default is P.empty:
            why.append(f"{p.name} has no default")
    for p in have_pos[len(want_pos) :]:
        if p.default is P.empty:
            why.append(f"extra parameter {p.name} without a default")
    for p in want.parameters.values():
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and p.kind not in kinds:
            why.append(f"no {p}")
    return why


@pytest.mark.parametrize(
    ("protocol", "cls"), CONFORMING, ids=[f"{c.__name__}-{p.__name__}" for p, c in CONFORMING]
)
def test_each_role_and_backend_has_its_protocol_s_methods(protocol: type, cls: type) -> None:
    methods = protocol_methods(protocol)
    assert methods, protocol
    for name, declared in methods.items():
        implemented = getattr(cls, name, None)
        assert callable(implemented), f"{cls.__name__} has no {name} ({protocol.__name__})"
        problems = incompatibilities(declared, implemented)
        assert problems == [], f"{cls.__name__}.{name} vs {protocol.__name__}: {problems}"


def test_the_signature_check_sees_a_mismatch() -> None:
    class Narrow:
        def sample_and_commit(self, n: int) -> dict[str, Any]:  # no min_version, wait_s
            return {}

        async def close(self) -> None:  # a coroutine where a plain method is declared
            pass

    protocol = protocol_methods(SamplerRole)
    assert incompatibilities(protocol["sample_and_commit"], Narrow.sample_and_commit) == [
        "no positional parameter min_version",
        "no positional parameter wait_s",
    ]
    assert incompatibilities(protocol["close"], Narrow.close) == [
        "one is a coroutine function, the other not"
    ]
    assert incompatibilities(protocol_methods(PolicyBackend)["evict"], HFBackend.evict) == []


# ---- the runtime's calls by name -----------------------------------------------------------------------
BY_NAME = re.compile(r"(^|_)call$|^foreach_actor")  # LearnerGroup.call, _call, store_call, foreach_actor*
# which role a call goes to: by the words of its receiver (`self.topo.store`, `group.rank0`, ...); else the
# role of its module (MODULE_ROLE); else by the words of the function it is in (`store_pid(handle)`)
ROLE_WORDS = (
    ("retrieval", "retrieval"),
    ("store", "store"),
    ("backup", "backup"),
    ("learner", "learner"),
    ("rank0", "learner"),
    ("group", "learner"),
    ("manager", "sampler"),
    ("sampler", "sampler"),
)
# the modules that talk to one role only (`self.call("stop")` in LearnerGroup, `self._call` in RemoteStore)
MODULE_ROLE = {
    "runtime/learner_group.py": "learner",
    "runtime/retrieval_actor.py": "retrieval",
    "storage/replay_store_actor.py": "store",
}
SCANNED = ("runtime/*.py", "storage/replay_store_actor.py")


def calls_by_name(source: str) -> list[tuple[int, str, str, str]]:
    """(line, receiver, method, the function it is in) of each call on a role handle by method name."""
    out = []
    for function, call in _calls(ast.parse(source), ""):
        func = call.func
        if not isinstance(func, ast.Attribute | ast.Name):
            continue
        called = func.attr if isinstance(func, ast.Attribute) else func.id
        if called == "remote" and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute):
            out.append((call.lineno, ast.unparse(func.value.value), func.value.attr, function))
        elif BY_NAME.search(called):
            sent = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if sent:
                out.append((call.lineno, ast.unparse(func), sent[0], function))
    return sorted(out)


def _calls(node: ast.AST, function: str) -> list[tuple[str, ast.Call]]:
    """Every call under `node`, with the name of the innermost function it is in."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        function = node.name
    here = [(function, node)] if isinstance(node, ast.Call) else []
    return here + [c for child in ast.iter_child_nodes(node) for c in _calls(child, function)]


def role_of(receiver: str, function: str, module: str) -> str | None:
    def by_words(text: str) -> str | None:
        return next((role for word, role in ROLE_WORDS if word in text.lower()), None)

    return by_words(receiver) or MODULE_ROLE.get(module) or by_words(function)


def undeclared(module: str, source: str) -> list[str]:
    """The calls of `source` whose role is unknown or whose method its role's Protocol does not declare."""
    host = set(protocol_methods(HostRole))  # every host answers these itself, whatever its role
    out = []
    for line, receiver, method, function in calls_by_name(source):
        role = role_of(receiver, function, module)
        if role is None:
            out.append(f"{module}:{line}: {receiver}.{method}: which role? (ROLE_WORDS, MODULE_ROLE)")
        elif method not in set(protocol_methods(ROLES[role])) | host:
            out.append(f"{module}:{line}: {receiver}.{method}: not in {ROLES[role].__name__}")
    return out


def runtime_sources() -> dict[str, str]:
    files = sorted({p for pattern in SCANNED for p in ROOT.glob(pattern)})
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_every_method_the_runtime_calls_by_name_is_declared_in_its_role_s_protocol() -> None:
    sources = runtime_sources()
    problems = [p for module, source in sources.items() for p in undeclared(module, source)]
    assert problems == []
    # the scan sees the calls the README's chains make (it is not vacuously empty)
    seen = {call[2] for source in sources.values() for call in calls_by_name(source)}
    assert {"train_step", "sample_and_commit", "run_once", "put_raw", "set_learner_version"} <= seen


def test_a_new_undeclared_call_fails_the_scan() -> None:
    source = (
        "def tick(self, group, step, manager):\n"
        "    ray.get(self.topo.store.compact.remote())\n"  # a store method no Protocol declares
        "    self.topo.learners.call('train_step', 0.05)\n"  # declared
        "    self.supervisor.store_call(step, 'vacuum')\n"  # undeclared, sent by name
        "    manager.foreach_actor_async('sample_and_commit', 't')\n"  # declared
        "    ray.get(self.topo.oracle.ask.remote())\n"  # a handle of no known role
        "    ray.get(group.rank0.pid.remote())\n"  # the host's own
    )
    assert undeclared("runtime/driver.py", source) == [
        "runtime/driver.py:2: self.topo.store.compact: not in StoreRole",
        "runtime/driver.py:4: self.supervisor.store_call.vacuum: not in StoreRole",
        "runtime/driver.py:6: self.topo.oracle.ask: which role? (ROLE_WORDS, MODULE_ROLE)",
    ]


def test_a_backend_serves_its_own_turns_only_when_it_is_a_turn_server() -> None:
    """`as_turn_server` asks the declared TurnServer Protocol (not a probe for one method): vLLM's backend,
    every TurnServer member its own, is used as it is; a plain PolicyBackend gets BatchedTurns."""

    class Served(VLLMBackend):
        def __init__(self) -> None:  # no engine: only the members matter here
            self.version = 0

    served = Served()
    assert as_turn_server(served) is served
    scripted = ScriptedBackend.__new__(ScriptedBackend)  # no tokenizer needed: nothing is sampled
    server = as_turn_server(scripted)
    assert isinstance(server, BatchedTurns) and server.backend is scripted
    server.close()
