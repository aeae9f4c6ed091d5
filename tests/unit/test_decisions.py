"""The run's decisions as a table (runtime/decisions.py): every failure kind of every role → the one decision,
with the budgets used so far; the table covers every (role, kind) pair the types allow, and no other pair can
be written. Also the store client's one retry policy (runtime/store_client.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from runtime import decisions as d
from runtime.decisions import (
    BackupFailed,
    Budgets,
    DropSampler,
    LearnerFailed,
    LeaveToRay,
    MoveLearnerPort,
    ReconcileLearner,
    RestartLearner,
    RestartRole,
    RetrievalFailed,
    RoleFailed,
    RunFailed,
    SamplerFailed,
    Stop,
    StopNow,
    StopOnConfig,
    StoreFailed,
    WaitForStore,
    decide,
)

ROOT = Path(__file__).resolve().parents[2]
DIED = "RayActorError: its worker process exited (SYSTEM_ERROR)"
RAISED = "ValueError: boom"
LIMITS = {"learner": 2, "store": 3, "backup": 1, "sampler": 1}
BAD = "ConfigError: x.y = 3 is invalid"


def budgets(**used: int) -> Budgets:
    """Budgets with `used` restarts already counted per role (a sampler's in slot 0)."""
    b = Budgets.from_limits(**LIMITS)
    for role, n in used.items():
        b.record(role, 0, "earlier", n)
    return b


def cfg_stop(role: str, key: str, log_path: str | None = None) -> StopOnConfig:
    return StopOnConfig(role, f"{BAD} [config key: {key}]", key, log_path)


TABLE = [
    # samplers: Ray restarts a dead one; one that raised (or whose agent endpoint failed) is replaced
    (SamplerFailed("died", DIED, 0), {}, LeaveToRay("sampler", 0, DIED)),
    (SamplerFailed("died", DIED, 0, retiring=True), {"sampler": 1}, LeaveToRay("sampler", 0, DIED)),
    (SamplerFailed("raised", RAISED, 0), {}, RestartRole("sampler", 0, 1, 0.0, RAISED)),
    (SamplerFailed("raised", RAISED, 0), {"sampler": 1}, DropSampler(0, RAISED)),
    (SamplerFailed("raised", RAISED, 5), {"sampler": 1}, RestartRole("sampler", 5, 1, 0.0, RAISED)),
    (SamplerFailed("raised", RAISED, 0, retiring=True), {}, DropSampler(0, RAISED, retiring=True)),
    (
        SamplerFailed("endpoint", "agent endpoint x", 2),
        {},
        RestartRole("sampler", 2, 1, 0.0, "agent endpoint x"),
    ),
    (
        SamplerFailed("endpoint", "agent endpoint x", 2, retiring=True),
        {},
        DropSampler(2, "agent endpoint x", True),
    ),
    (
        SamplerFailed("config", "bad [config key: model.path]", 0, key="model.path", log_path="/l/s-0.log"),
        {"sampler": 1},
        StopOnConfig("sampler", "bad [config key: model.path]", "model.path", "/l/s-0.log"),
    ),
    (
        SamplerFailed("none-healthy", "for 180 s: boom"),
        {"sampler": 1},
        Stop("sampler", 1, 1, "for 180 s: boom", why="no healthy sampler (restarts exhausted)"),
    ),
    # the store: Ray restarts it in place; gone for good stops the run
    (StoreFailed("died", DIED), {"store": 3}, WaitForStore(DIED)),
    (
        StoreFailed("unavailable", "no answer within 600 s"),
        {"store": 3},
        Stop("store", 3, 3, "no answer within 600 s"),
    ),
    (StoreFailed("config", BAD, "store.dir"), {}, cfg_stop("store", "store.dir")),
    # the backup: a new actor within its budget; a lost store under it is waited for
    (BackupFailed("died", DIED), {}, RestartRole("backup", 0, 1, 0.0, DIED)),
    (BackupFailed("raised", RAISED), {}, RestartRole("backup", 0, 1, 0.0, RAISED)),
    (BackupFailed("raised", RAISED), {"backup": 1}, Stop("backup", 1, 1, RAISED)),
    (BackupFailed("store-lost", DIED), {"backup": 1}, WaitForStore(DIED)),
    (BackupFailed("config", BAD, "algo.M"), {}, cfg_stop("backup", "algo.M")),
    # the learner: a single rank whose store was lost is kept; anything else restarts every rank
    (LearnerFailed("store-lost", DIED, ranks=1), {"learner": 2}, ReconcileLearner(DIED)),
    (LearnerFailed("store-lost", DIED, ranks=2), {}, RestartLearner(1, 1.0, DIED)),
    (LearnerFailed("died", DIED), {}, RestartLearner(1, 1.0, DIED)),
    (LearnerFailed("died", DIED), {"learner": 2}, Stop("learner", 2, 2, DIED)),
    (LearnerFailed("raised", RAISED), {"learner": 1}, RestartLearner(2, 2.0, RAISED)),
    (LearnerFailed("unreconciled", DIED), {}, RestartLearner(1, 1.0, DIED)),
    (
        LearnerFailed("start-failed", "restart failed: x"),
        {"learner": 1},
        RestartLearner(2, 2.0, "restart failed: x"),
    ),
    (
        LearnerFailed("port-taken", "Address already in use"),
        {"learner": 1},
        MoveLearnerPort("Address already in use"),
    ),
    (
        LearnerFailed("final-checkpoint", "failed every time"),
        {"learner": 1},
        Stop("learner", 1, 2, "failed every time"),
    ),
    (LearnerFailed("config", BAD, key="learner.ranks"), {}, cfg_stop("learner", "learner.ranks")),
    # the retrieval service: a new one within its fixed budget
    (RetrievalFailed("died", DIED), {}, RestartRole("retrieval", 0, 1, 0.0, DIED)),
    (RetrievalFailed("died", DIED), {"retrieval": 3}, Stop("retrieval", 3, 3, DIED)),
    (RetrievalFailed("config", BAD, "env.corpus"), {}, cfg_stop("retrieval", "env.corpus")),
    # the run itself: a second interrupt kills every actor at once
    (
        RunFailed("interrupted", "stopped at once by a second SIGTERM", 15),
        {},
        StopNow(15, "stopped at once by a second SIGTERM"),
    ),
]


@pytest.mark.parametrize("failure, used, decision", TABLE)
def test_each_failure_gets_its_one_decision(failure, used, decision):
    b = budgets(**used)
    before = {key: list(causes) for key, causes in b.causes.items()}
    assert decide(failure, b) == decision
    assert b.causes == before  # decide writes nothing


def possible_pairs() -> set[tuple[str, str]]:
    """Every (role, kind) the failure types allow: each role's kinds, read from its `kind` Literal."""
    hints = {t: typing.get_type_hints(t) for t in typing.get_args(d.Failure)}
    return {(t.role, kind) for t, h in hints.items() for kind in typing.get_args(h["kind"])}


def test_the_table_covers_every_pair_the_types_allow_and_only_those():
    covered = {(f.role, f.kind) for f, _, _ in TABLE}
    assert covered == possible_pairs()
    assert len(covered) == 5 + 3 + 4 + 8 + 2 + 1  # sampler, store, backup, learner, retrieval, run: 23
    assert ("retrieval", "store-lost") not in covered and ("store", "raised") not in covered


def test_config_means_one_thing_for_every_role():
    """A failure the configuration causes stops the run with one line naming the key, whatever the role and
    whatever its budget: no role restarts on it."""
    for failure, _, decision in TABLE:
        if failure.kind == "config":
            assert isinstance(decision, StopOnConfig) and decision.key in decision.message
            assert "\n" not in decision.message and decision.role == failure.role


def test_a_stop_is_one_line_naming_the_role_its_limit_key_and_last_error():
    stop = decide(LearnerFailed("died", DIED), budgets(learner=2))
    assert isinstance(stop, Stop)
    assert stop.message == (
        "the learner failed and its restarts are used up (2 of run.max_learner_restarts = 2); "
        f"last error: {DIED}"
    )
    error = stop.error()
    assert isinstance(error, RoleFailed) and (error.role, error.last_error) == ("learner", DIED)
    store = decide(StoreFailed("unavailable", "gone"), budgets(store=3))
    assert isinstance(store, Stop) and "(3 of run.max_store_restarts = 3)" in store.message
    none = decide(SamplerFailed("none-healthy", "for 180 s: ValueError: x"), budgets())
    assert isinstance(none, Stop)
    assert none.message == "no healthy sampler (restarts exhausted): for 180 s: ValueError: x"


def test_sampler_budgets_count_per_slot_and_the_recorded_restart_is_the_next_attempt():
    b = budgets()
    assert decide(SamplerFailed("raised", RAISED, 3), b) == RestartRole("sampler", 3, 1, 0.0, RAISED)
    assert b.record("sampler", 3, RAISED) == 1  # counting never raises: only `decide` stops
    assert decide(SamplerFailed("raised", RAISED, 3), b) == DropSampler(3, RAISED)
    assert decide(SamplerFailed("raised", RAISED, 4), b) == RestartRole("sampler", 4, 1, 0.0, RAISED)
    assert b.record("sampler", 3, RAISED) == 2 and b.used("sampler", 3) == 2


def test_a_kind_its_role_does_not_have_cannot_be_written(tmp_path):
    """Each role's kinds are a Literal: mypy strict (which covers runtime/) refuses a pair no role produces,
    the one failure type of old let anyone write; so does the constructor at run time."""
    with pytest.raises(ValueError, match=r"^RetrievalFailed has no kind 'store-lost': only died, config$"):
        RetrievalFailed("store-lost", DIED)  # type: ignore[arg-type]
    snippet = tmp_path / "pair.py"
    snippet.write_text(
        'from runtime.decisions import RetrievalFailed\n\nRetrievalFailed("store-lost", "x")\n'
    )
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    mypy = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        "--no-incremental",
        "--follow-imports=silent",
        str(snippet),
    ]
    done = subprocess.run(mypy, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and 'Argument 1 to "RetrievalFailed" has incompatible type' in done.stdout


def test_decisions_import_no_ray():
    tree = ast.parse((ROOT / "runtime/decisions.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "collections", "collections.abc", "dataclasses", "typing"}, imported


class ScriptedStore:
    """`RemoteStore._call` answers in order: an exception instance is raised, anything else returned."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), []

    def __call__(self, method, *args):  # set on the class: not bound, no client argument
        self.calls.append((method.__name__, args))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_the_store_client_hands_a_lost_store_to_on_lost_and_repeats_the_call_once(monkeypatch):
    import ray

    from runtime.store_client import StoreLink
    from storage.replay_store_actor import RemoteStore
    from system.roles import StoreRole

    lost = ray.exceptions.RayActorError()
    script = ScriptedStore(lost, {"trees": 1})
    monkeypatch.setattr(RemoteStore, "_call", script)
    seen = []
    store = StoreLink(handle=None, on_lost=seen.append)
    assert store.call(StoreRole.stats) == {"trees": 1}
    assert seen == [lost] and script.calls == [("stats", ()), ("stats", ())]
    monkeypatch.setattr(RemoteStore, "_call", ScriptedStore(lost, lost))
    with pytest.raises(ray.exceptions.RayActorError):  # lost again after the wait: the caller's failure
        store.call(StoreRole.release, 4)
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
    with pytest.raises(StoreUnavailable, match=r"^RayActorError: "):
        store.admit(4)
    assert script.calls == [("admit", (4,))]  # not repeated: the sampler's next call asks again
