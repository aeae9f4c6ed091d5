"""Evaluation split over worker threads (experiments/evaluation.py): the same episodes, the same draws."""

from __future__ import annotations

import pytest

from experiments.evaluation import evaluate, shard_bounds


def test_shard_bounds():
    # 160 episodes (32 questions x 5), 2 workers, batches of 32: 80 each would split a batch, so 96 + 64.
    assert shard_bounds(160, 2, 32) == [(0, 96), (96, 160)]
    assert shard_bounds(32, 2, 32) == [(0, 16), (16, 32)]  # one batch in all: halves
    assert shard_bounds(5, 8, 32) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]  # at most one per episode
    assert shard_bounds(7, 1, 2) == [(0, 7)] and shard_bounds(0, 2, 4) == []


def test_two_workers_give_the_one_worker_results(tiny_model_dir, tmp_path):
    from actors.sampler_setup import build_env, load_split
    from configs.schema import load_config

    cfg = load_config(None, [f"run.run_dir={tmp_path}", "env.eval_per_hop=3", "env.eval_hops=[2, 3]"])
    env = build_env(cfg)
    tasks = load_split(cfg, "eval", env)
    one = evaluate(cfg, tiny_model_dir, tasks, env, batch=2, samples=2, workers=1)
    two = evaluate(cfg, tiny_model_dir, tasks, env, batch=2, samples=2, workers=2)
    assert one["n"] == two["n"] == 6 and one["sampled"]["n"] == two["sampled"]["n"] == 12
    assert one["task_rewards"] == two["task_rewards"]
    assert one["sampled_task_rewards"] == two["sampled_task_rewards"]
    # every sampled episode drew its own seed's tokens: the same tokens, so the same mean log-prob
    for key in ("token_nll", "mean_turns"):
        assert two["sampled"][key] == pytest.approx(one["sampled"][key], abs=1e-3)
        assert two[key] == pytest.approx(one[key], abs=1e-3)
