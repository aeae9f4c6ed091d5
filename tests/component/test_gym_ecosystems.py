"""Environments written for other ecosystems train unmodified through `env.name = gym`, grown into (4, 2)
trees: a SkyRL-gym env in this process, OpenEnv's echo env and a verifiers taskset (toolset + rubric) in a
worker of their own Python (verifiers pins openai<3). In-process roles (runtime/local.py), 2 learner steps.
"""

import json
import logging

import numpy as np
import pytest
from gym_fixtures import ENVS, echo_env, ecosystems_python, turn_taking_model, worker_path

from configs.schema import load_config
from runtime.local import build_local_run

SHAPE = ["algo.M=4", "algo.N=2", "learner.batch_trees=2", "learner.minibatches=1", "sampler.num_samplers=1"]
SHAPE += ["env.max_turns=3", "env.max_turn_tokens=32", "learner.lr=1e-3"]


@pytest.fixture(scope="session")
def turn_taking_model_dir(tmp_path_factory):
    return turn_taking_model(tmp_path_factory)


@pytest.fixture
def echo_env_dir(tmp_path):
    return echo_env(tmp_path)


def trunk_lengths(tree):
    """Turns of each of the root's M trajectories: a trunk continues through its lowest child (a tree's
    branches are sampled after all its trunks, so their node ids are higher)."""
    kids, lengths = tree.children, []
    for node in sorted(kids[0]):
        turns = 1
        while kids[node]:
            node, turns = min(kids[node]), turns + 1
        lengths.append(turns)
    return lengths


def check_shape(tree, M=4, N=2):
    """M trajectories from the root; N branches under each one with an anchor (T >= 2: the default
    `anchor_shortfall = skip`); every sampled token with its behavior log-prob; every leaf a reward."""
    lengths = trunk_lengths(tree)
    assert len(lengths) == M
    assert tree.num_leaves == M + N * sum(t >= 2 for t in lengths), (lengths, tree.num_leaves)
    for n in tree.nodes[1:]:
        assert len(n.tokens) > 0 and np.isfinite(n.behavior_logprobs).all()
    assert np.isfinite(tree.leaf_rewards()).all()
    return lengths


def train_two_steps(tmp_path, model_dir, overrides):
    cfg = load_config(overrides=[f"run.run_dir={tmp_path}", *SHAPE, "env.name=gym", *overrides])
    run = build_local_run(cfg, model_dir)
    try:
        losses = [run.step()["learner/loss"] for _ in range(2)]
        trees = [t for k in range(2) for t in run.store.get_trees(run.store.batch_tree_ids(k))]
        metrics = run.samplers[0].get_metrics()
    finally:
        run.close()
    assert len(losses) == 2 and np.isfinite(losses).all() and run.learner.version == 2
    assert len(trees) == 4  # 2 steps x learner.batch_trees = 2
    return trees, metrics


def test_skyrl_gym_gsm8k_multi_turn_trains_in_4_2_trees(tmp_path, turn_taking_model_dir):
    # skyrl_gym.make("gsm8k_multi_turn", extras=row) per task, rows in SkyRL's dataset format; the env ends
    # every episode itself at extra_info.max_turns = 3: each trunk has 3 turns, anchors {1, 2} -> 2 branches
    trees, m = train_two_steps(
        tmp_path,
        turn_taking_model_dir,
        [
            "env.factory=skyrl_gym:make",
            "env.factory_args={id: gsm8k_multi_turn}",
            f"env.data={ENVS}/gsm8k_mini.jsonl",
        ],
    )
    for tree in trees:
        assert check_shape(tree) == [3, 3, 3, 3]
        assert tree.num_leaves == 12 and len(tree.nodes) == 1 + 4 * 3 + 4 * (2 + 1)  # branches from 1 and 2
        assert tree.meta["task_id"].startswith("t-")  # a row without an id: its stable hash
    assert m["env/replays"] > 0 and m["env/replay_mismatch"] == 0 and m["env/errors"] == 0
    assert m["env/instances_live"] == 0  # closed once their trees were stored


def test_openenv_echo_env_trains_in_4_2_trees_in_its_own_python(
    tmp_path, turn_taking_model_dir, echo_env_dir, monkeypatch, caplog
):
    # the echo env `openenv init echo_env` writes, in the ecosystems' venv: reset(), then step(EchoAction(
    # message=turn text)); it pays 0.1 per character echoed and never ends: every episode is cut at 3 turns
    python = ecosystems_python()
    worker_path(monkeypatch, echo_env_dir)
    factory = "echo_env.server.echo_env_environment:EchoEnvironment"
    with caplog.at_level(logging.WARNING, logger="actors.envs.gym.adapter"):
        trees, m = train_two_steps(
            tmp_path,
            turn_taking_model_dir,
            [f"env.factory={factory}", f"env.python={python}", f"env.data={ENVS}/echo_prompts.jsonl"],
        )
    for tree in trees:
        assert check_shape(tree) == [3, 3, 3, 3]
        assert (tree.leaf_rewards() > 0).all()  # every path echoed something: 0.1 per character
    assert m["env/replays"] > 0 and m["env/replay_mismatch"] == 0 and m["env/errors"] == 0
    assert m["env/max_turns"] == 12 * 4  # every leaf was cut at env.max_turns
    cut = [r.getMessage() for r in caplog.records if "env.max_turns = 3" in r.getMessage()]
    assert cut and all("\n" not in line and "task echo-" in line for line in cut)
    assert len(cut) == len({line for line in cut})  # one line per task, not per episode


def test_verifiers_taskset_with_toolset_and_rubric_trains_in_4_2_trees(
    tmp_path, turn_taking_model_dir, monkeypatch
):
    # tests/gym_envs/kb_tools: a vf.Taskset whose tasks carry a vf.Toolset (`search`) and two @vf.reward
    # functions (correct: 1.0, searched: 0.25). The plain protocol's `search: …` lines become its tool
    # calls, `answer: …` (or a turn without a call) the final reply, which the task's rubric scores
    python = ecosystems_python()
    worker_path(monkeypatch, ENVS / "kb_tools")
    trees, m = train_two_steps(
        tmp_path,
        turn_taking_model_dir,
        ["env.factory=kb_tools.taskset:KBToolsTaskset", f"env.python={python}"],
    )
    for tree in trees:
        check_shape(tree)
        assert tree.meta["task_id"] in {"kb-0", "kb-1", "kb-2", "kb-3"}  # the taskset's own ids
        # the rubric's values: 0, 0.25 (searched), 1.0 (answered) or 1.25 (both)
        assert set(np.round(tree.leaf_rewards(), 4)) <= {0.0, 0.25, 1.0, 1.25}
    assert any((t.leaf_rewards() > 0).any() for t in trees)  # the toolset ran: some path searched
    assert m["env/replay_mismatch"] == 0 and m["env/errors"] == 0


def test_a_non_deterministic_env_has_its_replays_counted_and_branches_dropped(
    tmp_path, turn_taking_model_dir, caplog
):
    # each observation carries a fresh random draw, so a branch's replayed prefix never matches the stored
    # one: the branch is dropped with its reason, counted, and its tree keeps its trajectories
    overrides = ["env.factory=gym_envs.bad_envs:NotDeterministic", f"env.data={ENVS}/bad_tasks.jsonl"]
    with caplog.at_level(logging.WARNING):
        cfg = load_config(overrides=[f"run.run_dir={tmp_path}", *SHAPE, "env.name=gym", *overrides])
        run = build_local_run(cfg, turn_taking_model_dir)
        try:
            sampler = run.samplers[0]
            trees = sampler.sample(4)
            m = sampler.get_metrics()
            assert np.isfinite(run.step()["learner/loss"])  # the run goes on: what is left trains
        finally:
            run.close()
    assert len(trees) == 4  # no trunk replays (the pool keeps them): no tree is lost
    dropped = [r for t in trees for r in json.loads(t.meta.get("dropped_branches", "[]"))]
    assert dropped and all(r.startswith("replay mismatch on task task-") for r in dropped)
    assert m["env/replay_mismatch"] == len(dropped) == m["sampler/dropped_branches"]
    for t in trees:  # a branch that replayed is gone; one answered from the cache alone may stay
        lengths = trunk_lengths(t)
        branches = json.loads(t.meta.get("dropped_branches", "[]"))
        assert len(lengths) == 4 and t.num_leaves + len(branches) == 4 + 2 * sum(x >= 2 for x in lengths)
    lines = [r.getMessage() for r in caplog.records if "not deterministic" in r.getMessage()]
    assert lines and all("\n" not in x and "task task-" in x for x in lines)


def test_a_pool_of_one_replays_more_and_grows_the_same_trees(tmp_path, turn_taking_model_dir):
    # the same seeds with env.pool_size = 1 (every other trunk's instance evicted, rebuilt by replay) and 64:
    # identical trees, more replays, no mismatch (the env is deterministic). Lock step: one backend call per
    # round of turns, so both runs batch the same rows (the async loop gathers whatever is pending, which
    # under load differs between runs, and batched matmuls round differently: a loaded run's trees differed)
    base = [
        "sampler.loop=lockstep",
        "env.factory=skyrl_gym:make",
        "env.factory_args={id: gsm8k_multi_turn}",
        f"env.data={ENVS}/gsm8k_mini.jsonl",
    ]
    from runtime.builder import make_sampler as build_sampler

    grown = {}
    for size in (1, 64):
        cfg = load_config(
            overrides=[
                f"run.run_dir={tmp_path}/{size}",
                *SHAPE,
                "env.name=gym",
                *base,
                f"env.pool_size={size}",
            ]
        )
        sampler = build_sampler(cfg, turn_taking_model_dir)
        try:
            trees = sampler.sample_trees(sampler.tasks, np.random.default_rng(7))
            grown[size] = (trees, sampler.get_metrics())
        finally:
            sampler.close()
    (small, m1), (big, m64) = grown[1], grown[64]
    assert [len(t.nodes) for t in small] == [len(t.nodes) for t in big] == [25] * 4
    for a, b in zip(small, big, strict=True):
        assert all(
            np.array_equal(x.tokens, y.tokens) and np.array_equal(x.obs_tokens, y.obs_tokens)
            for x, y in zip(a.nodes, b.nodes, strict=True)
        )
    assert (
        m1["env/replays"] > m64["env/replays"]
        and m1["env/replay_mismatch"] == m64["env/replay_mismatch"] == 0
    )
