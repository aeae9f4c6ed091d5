"""The roles' contracts (system/roles.py, system/policy.py) hold on both sides: each role and backend class
has every method of its Protocol with a signature that takes the Protocol's calls, and every method name
the runtime sends to a role (`handle.name.remote(…)`, `call("name", …)`, `foreach_actor*("name", …)`,
`store_call(step, "name", …)`, `_call("name", …)`) is declared in that role's Protocol. On Ray a call by
name reaches whatever the role has of that name, so without this nothing would catch a call the role's
Protocol (and maybe the role) lacks until a run made it."""

from __future__ import annotations

import ast
import inspect
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


# ---- every call on an actor, anywhere in the tree ----------------------------------------------------------
FOLDERS = ("configs", "system", "storage", "actors", "learner", "runtime", "experiments", "faults", "launch")
FOLDERS += ("benchmarks", "tools", "examples", "tests")
ONLY_IN = {  # what may appear in one file of the tree only
    "ray.remote": "runtime/remote.py",  # the one place an actor class or a task is made
    ".remote(…)": "runtime/remote.py",  # the one place an actor's method is called: Handle.call
    "ray.kill": "runtime/roles.py",  # the one place an actor is stopped
    "start_actor(…)": "runtime/roles.py",
    "foreach_actor…(…)": "runtime/roles.py",  # RLlib's manager: the sampler pool's owner
    "FaultTolerantActorManager": "runtime/roles.py",  # the one thing that knows sampler health
}
PROTOCOLS = {p.__name__: p for p in (*ROLES.values(), HostRole)}
MANAGER = "FaultTolerantActorManager"


def tree_sources() -> dict[str, str]:
    files = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def actor_calls(module: str, source: str) -> list[str]:
    """Every way `source` reaches an actor that ONLY_IN restricts to one file, and every role method it names
    (`StoreRole.stats`) that its Protocol does not declare; as `module:line what`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        where = f"{module}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module == "ray":
            out += [f"{where} ray.{a.name}" for a in node.names if a.name in ("remote", "kill")]
        if (
            isinstance(node, ast.Attribute)
            and getattr(node.value, "id", "") == "ray"
            and node.attr in ("remote", "kill")
        ):
            out.append(f"{where} ray.{node.attr}")
        if getattr(node, "id", getattr(node, "name", None)) == MANAGER:  # a Name, or an imported alias
            out.append(f"{where} {MANAGER}")
        if isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if called == "remote" and not (
                isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "ray"
            ):
                out.append(f"{where} .remote(…)")
            first = node.args[0] if node.args else None
            if called == "call" and isinstance(first, ast.Constant) and isinstance(first.value, str):
                out.append(f"{where} a method by name: {first.value}")  # Handle.call takes Role.method
            if called == "start_actor":
                out.append(f"{where} start_actor(…)")
            if called.startswith("foreach_actor"):
                out.append(f"{where} foreach_actor…(…)")
        protocol = PROTOCOLS.get(getattr(node.value, "id", "")) if isinstance(node, ast.Attribute) else None
        if protocol and node.attr not in protocol_methods(protocol) and not node.attr.startswith("_"):
            out.append(f"{where} {protocol.__name__}.{node.attr}: not declared")
    return out


def misplaced(calls: list[str]) -> list[str]:
    """The calls of `actor_calls` outside the one file they may appear in (and every undeclared method)."""
    bad = []
    for call in calls:
        module, what = call.split(":", 1)[0], call.split(" ", 1)[1]
        if ONLY_IN.get(what) != module:
            bad.append(call)
    return bad


def test_actors_are_made_called_and_stopped_in_one_place_each_across_the_tree() -> None:
    calls = [c for module, source in tree_sources().items() for c in actor_calls(module, source)]
    assert misplaced(calls) == []
    seen = {c.split(" ", 1)[1] for c in calls}
    assert seen == set(ONLY_IN)  # the scan sees each of them where it belongs: not vacuously empty


def test_an_undeclared_or_misplaced_call_anywhere_fails_the_scan() -> None:
    """Mutations of real files: each added line is one way around the Protocols, and each is reported."""
    sources = tree_sources()
    added = {
        "runtime/driver.py": [
            "m = FaultTolerantActorManager([], 1)",  # a second owner of sampler health
            "ray.get(self.topo.store.actor.compact.remote())",  # a raw call on the actor, by any name
            "self.topo.store.call(StoreRole.compact)",  # through the handle, a method StoreRole lacks
            "f = lambda h: h.vacuum.remote()",  # through a lambda
            "self.topo._pool.foreach_actor('close')",  # the sampler pool by name, outside Roles
            "self.topo.learners.call('train_step', 0.05)",  # a method by name
        ],
        "faults/processes.py": ["ray.kill(handle)"],
        "benchmarks/bench_pipeline.py": ["from ray import remote", "ray.remote(f)"],
        "launch/cmd_drill.py": ["ray.get(h.learner.call(LearnerRole.train))"],
    }
    for module, lines in added.items():
        mutated = (
            sources[module] + "\n\ndef _mutant(self, f, h, handle):\n" + "".join(f"    {x}\n" for x in lines)
        )
        before = set(actor_calls(module, sources[module]))
        new = [c.split(" ", 1)[1] for c in misplaced(actor_calls(module, mutated)) if c not in before]
        assert len(new) == len(lines), (module, new)
    assert "StoreRole.compact: not declared" in str(misplaced(actor_calls("x.py", "StoreRole.compact")))


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
