"""The supervisor's decisions as a table (runtime/decisions.py): every role's failure → the one decision, with
the budgets used so far; and the source check that only runtime/roles.py starts or stops actors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from runtime.decisions import (
    Budgets,
    DropSampler,
    Failure,
    LeaveToRay,
    ReconcileLearner,
    RestartLearner,
    RestartRole,
    Stop,
    StopOnConfig,
    WaitForStore,
    decide,
)
from runtime.restart_policy import RoleFailed

ROOT = Path(__file__).resolve().parents[2]
DIED = "RayActorError: its worker process exited (SYSTEM_ERROR)"
RAISED = "ValueError: boom"
LIMITS = {"learner": 2, "store": 3, "backup": 1, "sampler": 1}


def budgets(**used: int) -> Budgets:
    """Budgets with `used` restarts already counted per role (a sampler's in slot 0)."""
    b = Budgets.from_limits(**LIMITS)
    for role, n in used.items():
        for _ in range(n):
            b.record(role, 0, "earlier")
    return b


TABLE = [
    # samplers: Ray restarts a dead one; one that raised (or whose agent endpoint failed) is replaced
    (Failure("sampler", "died", DIED, 0), {}, LeaveToRay("sampler", 0, DIED)),
    (Failure("sampler", "raised", RAISED, 0), {}, RestartRole("sampler", 0, 1, 0.0, RAISED)),
    (Failure("sampler", "raised", RAISED, 0), {"sampler": 1}, DropSampler(0, RAISED)),
    (Failure("sampler", "raised", RAISED, 5), {"sampler": 1}, RestartRole("sampler", 5, 1, 0.0, RAISED)),
    (
        Failure("endpoint", "raised", "RuntimeError: the agent endpoint did not start", 2),
        {},
        RestartRole("sampler", 2, 1, 0.0, "RuntimeError: the agent endpoint did not start"),
    ),
    (
        Failure(
            "sampler", "config", "bad [config key: model.path]", 0, key="model.path", log_path="/l/s-0.log"
        ),
        {},
        StopOnConfig("sampler", "bad [config key: model.path]", "model.path", "/l/s-0.log"),
    ),
    (
        Failure("sampler", "config", "bad", 0, key="env.data"),
        {"sampler": 1},
        StopOnConfig("sampler", "bad", "env.data", None),
    ),
    # the store: Ray restarts it in place; gone for good stops the run
    (Failure("store", "died", DIED), {}, WaitForStore(DIED)),
    (
        Failure("store", "unavailable", "no answer within 600 s"),
        {"store": 3},
        Stop("store", 3, 3, "no answer within 600 s"),
    ),
    # the backup: a new actor within its budget; a lost store under it is waited for
    (Failure("backup", "died", DIED), {}, RestartRole("backup", 0, 1, 0.0, DIED)),
    (Failure("backup", "raised", RAISED), {}, RestartRole("backup", 0, 1, 0.0, RAISED)),
    (Failure("backup", "raised", RAISED), {"backup": 1}, Stop("backup", 1, 1, RAISED)),
    (Failure("backup", "store-lost", DIED), {"backup": 1}, WaitForStore(DIED)),
    # the learner: a single rank whose store was lost is kept; anything else restarts every rank
    (Failure("learner", "store-lost", DIED, ranks=1), {}, ReconcileLearner(DIED)),
    (Failure("learner", "store-lost", DIED, ranks=2), {}, RestartLearner(1, 1.0, DIED)),
    (Failure("learner", "died", DIED), {}, RestartLearner(1, 1.0, DIED)),
    (Failure("learner", "raised", RAISED), {"learner": 1}, RestartLearner(2, 2.0, RAISED)),
    (Failure("learner", "unreconciled", DIED), {}, RestartLearner(1, 1.0, DIED)),
    (
        Failure("learner", "start-failed", "restart failed: x"),
        {"learner": 1},
        RestartLearner(2, 2.0, "restart failed: x"),
    ),
    (Failure("learner", "died", DIED), {"learner": 2}, Stop("learner", 2, 2, DIED)),
    (Failure("learner", "store-lost", DIED, ranks=1), {"learner": 2}, ReconcileLearner(DIED)),
    # the retrieval service: a new one within its fixed budget
    (Failure("retrieval", "died", DIED), {}, RestartRole("retrieval", 0, 1, 0.0, DIED)),
    (Failure("retrieval", "died", DIED), {"retrieval": 3}, Stop("retrieval", 3, 3, DIED)),
]


@pytest.mark.parametrize("failure, used, decision", TABLE)
def test_each_failure_gets_its_one_decision(failure, used, decision):
    b = budgets(**used)
    before = {key: list(budget.causes) for key, budget in b.used_by.items()}
    assert decide(failure, b) == decision
    assert {key: list(budget.causes) for key, budget in b.used_by.items()} == before  # decide writes nothing


def test_every_role_is_in_the_table():
    assert {f.role for f, _, _ in TABLE} == {"sampler", "store", "backup", "learner", "retrieval", "endpoint"}


def test_a_stop_is_one_line_naming_the_role_its_limit_key_and_last_error():
    stop = decide(Failure("learner", "died", DIED), budgets(learner=2))
    assert isinstance(stop, Stop)
    assert stop.message == (
        "the learner failed and its restarts are used up (2 of run.max_learner_restarts = 2); "
        f"last error: {DIED}"
    )
    assert isinstance(stop.error(), RoleFailed) and stop.error().role == "learner"
    store = decide(Failure("store", "unavailable", "gone"), budgets(store=3)).message  # type: ignore[union-attr]
    assert "(3 of run.max_store_restarts = 3)" in store and "\n" not in store


def test_sampler_budgets_count_per_slot_and_the_recorded_restart_is_the_next_attempt():
    b = budgets()
    first = decide(Failure("sampler", "raised", RAISED, 3), b)
    assert first == RestartRole("sampler", 3, 1, 0.0, RAISED)
    assert b.record("sampler", 3, RAISED) == 1
    assert decide(Failure("sampler", "raised", RAISED, 3), b) == DropSampler(3, RAISED)
    assert decide(Failure("sampler", "raised", RAISED, 4), b) == RestartRole("sampler", 4, 1, 0.0, RAISED)


def test_an_unknown_role_or_kind_is_refused():
    with pytest.raises(ValueError, match="unknown failure"):
        Failure("gpu", "died", "x")
    with pytest.raises(ValueError, match="unknown failure"):
        Failure("store", "melted", "x")


def test_decisions_import_no_ray():
    tree = ast.parse((ROOT / "runtime/decisions.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m == "ray" or m.startswith("ray.") for m in imported), imported
    assert imported <= {"__future__", "dataclasses", "runtime.restart_policy"}, imported


def actor_lifecycle_calls(path: Path) -> list[str]:
    """`start_actor(...)` and `ray.kill(...)` calls in one module (by name or attribute)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Name) and f.id == "start_actor") or (
            isinstance(f, ast.Attribute) and f.attr == "start_actor"
        ):
            found.append(f"{path.name}:{node.lineno} start_actor")
        if isinstance(f, ast.Attribute) and f.attr == "kill" and getattr(f.value, "id", "") == "ray":
            found.append(f"{path.name}:{node.lineno} ray.kill")
    return found


def test_only_roles_starts_or_kills_actors():
    modules = sorted((ROOT / "runtime").glob("*.py")) + sorted((ROOT / "launch").glob("*.py"))
    calls = {p.name: c for p in modules if (c := actor_lifecycle_calls(p))}
    assert set(calls) == {"roles.py"}, calls  # runtime/remote.py defines start_actor and calls neither
    assert len(calls["roles.py"]) >= 6  # store, backup, samplers, learner ranks, retrieval; kills


def test_the_source_check_finds_a_call_outside_roles(tmp_path):
    module = tmp_path / "driver.py"
    module.write_text(
        "import ray\n\ndef f(h):\n    ray.kill(h, no_restart=True)\n    start_actor(A, None, {})\n"
    )
    assert actor_lifecycle_calls(module) == ["driver.py:4 ray.kill", "driver.py:5 start_actor"]


def test_a_sampler_call_that_raises_reaches_the_caller_instead_of_exiting_the_process():
    """RLlib's FaultAwareApply exits the actor (SystemExit) on any exception; the sampler host's `apply`
    raises it to the driver, which decides (the old `apply` turned this ValueError into SystemExit)."""
    from runtime.sampler_role import SamplerHealth

    def broken(actor):
        raise ValueError("boom")

    with pytest.raises(ValueError, match=r"^boom$"):
        SamplerHealth().apply(broken)
    assert SamplerHealth().apply(lambda actor, x: x + 1, 2) == 3


class ScriptedStore:
    """`RemoteStore._call` answers in order: an exception instance is raised, anything else returned."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), []

    def __call__(self, method, *args):  # set on the class: not bound, no client argument
        self.calls.append((method, args))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_the_store_client_hands_a_lost_store_to_on_lost_and_repeats_the_call_once(monkeypatch):
    import ray

    from runtime.store_client import StoreLink
    from storage.replay_store_actor import RemoteStore

    lost = ray.exceptions.RayActorError()
    script = ScriptedStore(lost, {"trees": 1})
    monkeypatch.setattr(RemoteStore, "_call", script)
    seen = []
    store = StoreLink(handle=None, on_lost=seen.append)
    assert store.call("stats") == {"trees": 1}
    assert seen == [lost] and script.calls == [("stats", ()), ("stats", ())]
    monkeypatch.setattr(RemoteStore, "_call", ScriptedStore(lost, lost))
    with pytest.raises(ray.exceptions.RayActorError):  # lost again after the wait: the caller's failure
        store.call("release", 4)
    assert len(seen) == 2  # on_lost once per call


def test_a_samplers_store_client_ends_the_call_as_store_unavailable(monkeypatch):
    import ray

    from runtime import store_client
    from storage.replay_store_actor import RemoteStore
    from system.interfaces import StoreUnavailable

    monkeypatch.setattr(store_client, "STORE_DOWN_BACKOFF_S", 0.0)
    monkeypatch.setattr(store_client.time, "sleep", lambda s: None)
    script = ScriptedStore(ray.exceptions.RayActorError(), 5)
    monkeypatch.setattr(RemoteStore, "_call", script)
    store = store_client.StoreLink(handle=None, on_lost=store_client.store_unavailable)
    with pytest.raises(StoreUnavailable):
        store.admit(4)
    assert script.calls == [("admit", (4,))]  # not repeated: the sampler's next call asks again
