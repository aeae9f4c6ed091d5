"""The outside-environment adapter's parts (actors/envs/gym): history keys, the bounded pool and cache, task
records, the factory's ecosystem, the adapter's replay on a real SkyRL-gym env, and a dropped branch leaving
its tree (system/tree_build.py `TreeBuilder.remove`)."""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.envs.base import Task
from actors.envs.gym import GymEnv
from actors.envs.gym.factory import FactoryError, ecosystem_of, import_factory
from actors.envs.gym.hosts import make_host
from actors.envs.gym.pool import LRU, history_key
from actors.envs.gym.tasks import load_records, task_from_record
from system.tree import validate_tree
from system.tree_build import TreeBuilder

texts = st.lists(st.text(max_size=8), max_size=5)


@given(texts, texts)
def test_history_keys_name_histories_exactly(a, b):
    # length-prefixed: ["ab", ""] and ["a", "b"] differ although their concatenations are equal
    assert (history_key("t", a) == history_key("t", b)) == (a == b)
    assert history_key("t", a) != history_key("u", a)


def test_the_pool_is_bounded_and_closes_what_it_evicts():
    closed = []
    pool = LRU(2, on_evict=closed.append)
    pool.put(("a", "1"), "x")
    pool.put(("b", "1"), "y")
    assert pool.get(("a", "1")) == "x"  # a is now the most recent: b goes first
    pool.put(("c", "1"), "z")
    assert closed == ["y"] and len(pool) == 2
    assert pool.take(("a", "1")) == "x" and pool.take(("a", "1")) is None  # taken out: one holder at a time
    pool.put(("c", "2"), "w")
    assert sorted(pool.take_tasks(["c"])) == ["w", "z"] and len(pool) == 0


def test_rows_become_tasks_with_stable_ids(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "2 + 2?"}], "reward_spec": {"ground_truth": "4"}}]
    rows.append({"id": 7, "prompt": "Say hi."})
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    a, b = (task_from_record(r, i, "gym") for i, r in enumerate(load_records(path)))
    assert a.task_id == task_from_record(dict(reversed(list(rows[0].items()))), 0, "x").task_id  # key order
    assert (
        a.task_id.startswith("t-")
        and a.question == "2 + 2?"
        and a.record["reward_spec"]["ground_truth"] == "4"
    )
    assert b.task_id == "7" and b.messages == ({"role": "user", "content": "Say hi."},)
    own = task_from_record(
        {"id": "kb-0", "messages": [{"role": "user", "content": "q"}], "record": {"x": 1}}, 0, "g"
    )
    assert own.task_id == "kb-0" and own.record == {"x": 1}


@pytest.mark.parametrize(
    "text, why",
    [
        ("{not json}\n", "line 1: not JSON"),
        ('"a string"\n', "record 1 is not a JSON object"),
        ("", "no records"),
    ],
)
def test_a_bad_task_file_is_one_line(tmp_path, text, why):
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=why) as err:
        load_records(path)
    assert "\n" not in str(err.value)


def test_the_ecosystem_is_read_off_the_factory():
    from gym_envs.bad_envs import NeverEnds

    assert ecosystem_of(import_factory("skyrl_gym:make"), "skyrl_gym:make") == "skyrl"
    assert ecosystem_of(NeverEnds, "gym_envs.bad_envs:NeverEnds") == "skyrl"  # a subclass of BaseTextEnv
    with pytest.raises(FactoryError, match="cannot tell its ecosystem"):
        ecosystem_of(json.dumps, "json:dumps")
    with pytest.raises(FactoryError, match=r"expected 'package\.module:callable'"):
        import_factory("json.dumps")


def gsm8k_env(max_turns=3, pool_size=64):
    spec = "skyrl_gym:make"
    env = GymEnv(make_host(spec, {"id": "gsm8k_multi_turn"}), spec, max_turns=max_turns, pool_size=pool_size)
    row = {"prompt": [{"role": "user", "content": "2 + 2?"}], "reward_spec": {"ground_truth": "4"}}
    row["extra_info"] = {"max_turns": 3}
    return env, task_from_record(row, 0, "gym")


def walk(env, task, actions):
    history, results = [], []
    for a in actions:
        res = env.step(task, history, a)
        results.append(res)
        history.append(res.call)
    return results


def test_a_branch_replays_its_prefix_and_a_cached_step_calls_nothing():
    env, task = gsm8k_env()
    try:
        assert env.prompt_messages(task) == [{"role": "user", "content": "2 + 2?"}]
        trunk = walk(env, task, ["think", "more", "#### 4"])
        # gsm8k_multi_turn: 0.2 / 3 per formatted-but-wrong turn, 1.0 correct; the leaf's reward is the sum
        assert [r.done for r in trunk] == [False, False, True] and trunk[-1].reward == pytest.approx(1.0)
        assert trunk[0].info["messages"][0]["role"] == "user"  # SkyRL answers as the user
        before = env.metrics()
        # a branch at anchor 1: its trunk's instance has moved on, so a new one replays "think", then steps
        branch = env.step(task, [trunk[0].call], "#### 5")
        m = env.metrics()
        assert (
            m["env/replays"] - before["env/replays"] == 1
            and m["env/replayed_steps"] - before["env/replayed_steps"] == 1
        )
        assert branch.done is False and m["env/replay_mismatch"] == 0
        # the same step again: from the cache, no instance stepped
        again = env.step(task, [trunk[0].call], "#### 5")
        assert again.observation == branch.observation and env.metrics()["env/steps"] == m["env/steps"]
        assert env.metrics()["env/cache_hits"] == m["env/cache_hits"] + 1
    finally:
        env.close()


def test_the_run_cuts_an_episode_at_max_turns_with_its_return():
    env, task = gsm8k_env(max_turns=2)
    try:
        env.prompt_messages(task)
        cut = walk(env, task, ["a", "b"])[-1]
        assert cut.done and cut.info["finish"] == "max_turns" and cut.reward == 0.0
        assert env.metrics()["env/max_turns"] == 1
    finally:
        env.close()


def test_a_dropped_branch_leaves_its_tree_renumbered_and_valid():
    b = TreeBuilder("t", [1, 2])
    trunk = [b.add_turn(0, [5], [-0.1])]
    trunk.append(b.add_turn(trunk[0], [6], [-0.2]))
    branch = b.add_turn(trunk[0], [7], [-0.3])  # the branch to drop, under the anchor trunk[0]
    keep = b.add_turn(trunk[0], [8], [-0.4])
    for leaf in (trunk[1], branch, keep):
        b.set_reward(leaf, 1.0)
    ids = b.remove([branch])
    tree = b.build()
    validate_tree(tree)
    assert ids == {0: 0, 1: 1, 2: 2, 4: 3} and len(tree.nodes) == 4
    assert [int(n.tokens[0]) for n in tree.nodes[1:]] == [5, 6, 8] and tree.nodes[3].parent == 1
    assert np.isnan(tree.nodes[1].reward) and tree.nodes[3].reward == 1.0
    with pytest.raises(ValueError, match="root"):
        b.remove([0])


def test_tasks_of_our_own_envs_are_unchanged():
    # the general Task's new fields default away: equality and hashing stay those of (id, question, golds)
    a = Task("q1", "who?", ("x",), "d")
    assert a == Task("q1", "who?", ("x",), "d", messages=({"role": "user", "content": "who?"},))
    assert hash(a) == hash(Task("q1", "who?", ("x",), "d", record={"k": 1}))
