"""Bad outside environments get one line naming the task, and the run goes on where the failure is the
environment's: a factory that does not import (exit 2 before anything starts), an env raising in reset or in
step, one that never ends (cut at env.max_turns), a non-finite reward; a worker that dies. The misbehaving
envs (tests/gym_envs/bad_envs.py) are SkyRL-gym envs that fail on task-0 only (`"bad": true` in its row).
"""

import logging
import re
import sys

import numpy as np
import pytest
from gym_fixtures import ENVS, HERE, ecosystems_python, turn_taking_model, worker_path

from configs.schema import load_config
from launch.cli import main
from runtime.builder import make_sampler as build_sampler

SHAPE = ["algo.M=4", "algo.N=2", "env.max_turns=3", "env.max_turn_tokens=32", "sampler.num_samplers=1"]
TASKS = f"env.data={ENVS}/bad_tasks.jsonl"


@pytest.fixture(scope="session")
def turn_taking_model_dir(tmp_path_factory):
    return turn_taking_model(tmp_path_factory)


def grow(tmp_path, model_dir, env_class, *extra):
    """One tree per task (task-0 first) from env_class; the trees, the sampler's metrics."""
    cfg = load_config(
        overrides=[
            f"run.run_dir={tmp_path}",
            *SHAPE,
            "env.name=gym",
            f"env.factory={env_class}",
            TASKS,
            *extra,
        ]
    )
    sampler = build_sampler(cfg, model_dir)
    try:
        trees = sampler.sample_trees(sampler.tasks, np.random.default_rng(0))
        return trees, {**sampler.get_metrics(), "dropped_trees": sampler.dropped_trees}
    finally:
        sampler.close()


def lines_about(caplog, text):
    found = [r.getMessage() for r in caplog.records if text in r.getMessage()]
    assert found, [r.getMessage() for r in caplog.records]
    assert all("\n" not in line for line in found)  # one line each
    return found


@pytest.mark.parametrize(
    "factory, why",
    [
        (
            "no_such_module:make_env",
            "env.factory = 'no_such_module:make_env': no module named 'no_such_module'",
        ),
        ("skyrl_gym:make_env", "env.factory = 'skyrl_gym:make_env': skyrl_gym has no attribute 'make_env'"),
        ("json:dumps", "env.factory = 'json:dumps': cannot tell its ecosystem"),
    ],
)
def test_a_factory_that_cannot_be_used_exits_2_at_load_with_one_line(tmp_path, capsys, factory, why):
    rc = main(["train", "--run-dir", str(tmp_path / "run"), "env.name=gym", f"env.factory={factory}", TASKS])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(f"treeopsd train: {why}") and "\n" not in err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_a_factory_that_does_not_import_in_env_python_exits_2_at_load(tmp_path, capsys):
    python = ecosystems_python()  # the worker starts, its import fails there: the same one line
    rc = main(
        [
            "train",
            "--run-dir",
            str(tmp_path / "run"),
            "env.name=gym",
            "env.factory=vf_missing:Taskset",
            f"env.python={python}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert (
        rc == 2 and err == "treeopsd train: env.factory = 'vf_missing:Taskset': no module named 'vf_missing'"
    )


def test_missing_task_data_exits_2_at_load(tmp_path, capsys):
    rc = main(["train", "--run-dir", str(tmp_path / "run"), "env.name=gym", "env.factory=skyrl_gym:make"])
    err = capsys.readouterr().err.strip()
    assert (
        rc == 2
        and "env.data must name a task file for env.factory = skyrl_gym:make" in err
        and "\n" not in err
    )


def test_an_env_raising_in_reset_loses_that_tree_only(tmp_path, turn_taking_model_dir, caplog):
    with caplog.at_level(logging.WARNING):
        trees, m = grow(tmp_path, turn_taking_model_dir, "gym_envs.bad_envs:RaisesInReset")
    assert sorted(t.meta["task_id"] for t in trees) == ["task-1", "task-2", "task-3"]
    assert m["dropped_trees"] == 1 and m["env/errors"] == 1
    (line,) = lines_about(caplog, "failed in reset")
    assert line.startswith("env.factory gym_envs.bad_envs:RaisesInReset failed in reset on task task-0: ")
    assert re.search(r"ConnectionError: the sandbox did not come up; tree task-0-[0-9a-f]+ dropped$", line)


def test_an_env_raising_in_step_is_a_verifier_error_named_in_one_line(
    tmp_path, turn_taking_model_dir, caplog
):
    # on_verifier_error = zero (the default): the failed episodes end with reward 0 and are kept; drop_tree:
    # the task's tree goes. The other tasks' trees are whole either way.
    with caplog.at_level(logging.WARNING):
        trees, m = grow(tmp_path, turn_taking_model_dir, "gym_envs.bad_envs:RaisesInStep")
        kept, _ = grow(
            tmp_path / "d",
            turn_taking_model_dir,
            "gym_envs.bad_envs:RaisesInStep",
            "algo.on_verifier_error=drop_tree",
        )
    lines = lines_about(
        caplog, "failed in step on task task-0 at turn 2: KeyError: \"tool 'calculator' crashed\""
    )
    assert m["env/errors"] >= 1 and len(lines) >= 1
    bad = next(t for t in trees if t.meta["task_id"] == "task-0")
    assert "verifier_error" in bad.meta["finish"]
    assert sorted(t.meta["task_id"] for t in kept) == ["task-1", "task-2", "task-3"]


def test_a_non_finite_reward_is_named_in_one_line(tmp_path, turn_taking_model_dir, caplog):
    with caplog.at_level(logging.WARNING):
        trees, m = grow(tmp_path, turn_taking_model_dir, "gym_envs.bad_envs:NanReward")
    lines_about(
        caplog, "failed in step on task task-0 at turn 1: ValueError: reward nan is not a finite number"
    )
    assert m["env/nonfinite_rewards"] >= 1 and len(trees) == 4
    for t in trees:  # what is stored is finite: the failed episodes end as verifier errors with reward 0
        assert np.isfinite(t.leaf_rewards()).all()


def test_an_env_that_never_ends_is_cut_at_max_turns_with_one_line_per_task(
    tmp_path, turn_taking_model_dir, caplog
):
    with caplog.at_level(logging.WARNING):
        trees, m = grow(tmp_path, turn_taking_model_dir, "gym_envs.bad_envs:NeverEnds")
    lines = lines_about(caplog, "did not end its episode within env.max_turns = 3 turns")
    assert sorted(line.split("task ")[1].split(":")[0] for line in lines) == [
        "task-0",
        "task-1",
        "task-2",
        "task-3",
    ]
    for t in trees:  # 3 turns of 0.5 each on every path: the return of a cut episode
        assert t.num_leaves == 12 and np.allclose(t.leaf_rewards(), 1.5)
    assert m["env/max_turns"] == 4 * 12


def test_a_worker_that_dies_fails_its_episodes_and_the_next_reset_starts_a_new_one(monkeypatch):
    from actors.envs.base import EnvFailure, Task
    from actors.envs.gym import GymEnv
    from actors.envs.gym.hosts import make_host

    worker_path(monkeypatch, HERE)  # the worker runs this venv's Python here: skyrl-gym is installed in it
    host = make_host("gym_envs.bad_envs:NeverEnds", {}, python=sys.executable, ecosystem="skyrl")
    env = GymEnv(host, "gym_envs.bad_envs:NeverEnds", max_turns=3)
    task = Task("t", "q", (), "gym", messages=({"role": "user", "content": "q"},))
    try:
        env.prompt_messages(task)
        host._proc.kill()  # the worker dies under the instance the first trajectory would step
        host._proc.wait()
        died = r"failed in step on task t at turn 1: the environment worker \(.*\) died, exit code -9 before"
        with pytest.raises(EnvFailure, match=r"^env.factory gym_envs.bad_envs:NeverEnds " + died + " step$"):
            env.step(task, [], "hello")
        assert env.step(task, [], "hello").observation == "go on"  # a new worker, a new instance
    finally:
        env.close()
