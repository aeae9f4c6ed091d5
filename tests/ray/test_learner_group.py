"""The sharded learner on local Ray (CPU, gloo): 2 LearnerRankActors with FSDP2 against the one-process
Learner on the same trees — the same loss and updated weights; DCP checkpoints resumed with 1 and 2 ranks
and exported to an HF folder; a SIGKILLed or hung rank ends the step with an error naming it, and a resumed
group trains every batch once."""

import os
import signal
import time

import pytest
import torch
from learner_group_fixtures import (
    B,
    batches,
    group_cfg,
    load_tiny,
    max_diff,
    reference,
    start_group,
    store_with,
    train,
)

from runtime.roles import stop_learner_group
from storage.checkpoint import load_latest
from storage.dcp_checkpoint import full_model_tensors
from system.roles import HostRole, LearnerRole

pytestmark = [pytest.mark.ray, pytest.mark.slow]
# fp32 summation order differs between 1 and 2 ranks (~1e-7 relative); Adam's normalized update turns a
# near-cancelling gradient component's rounding into up to ~lr·1e-2, so the weights are compared at lr 3e-4
TOL = 1e-5


def test_two_ranks_train_the_one_rank_step(ray_cluster, tmp_path, tiny_model_dir):
    # The rank actors' wiring (placement group, rendezvous, checkpoint) with the default method; the ranks'
    # own arithmetic with both methods, split trees and padding passes included, is proven without Ray in
    # tests/component/test_sharded_distributed.py (the same code in the same processes' shape, ~30 CPU-s less)
    cfg = group_cfg(tmp_path, "treeopsd")
    ref = reference(tiny_model_dir, cfg)
    (trees,) = batches(ref.model, ref.tokenizer, 1)
    store = store_with(tmp_path / "store", trees)
    group = start_group(cfg, tiny_model_dir, store)
    try:
        out = train(group)
    finally:
        stop_learner_group(group)
    want = ref.step(trees)
    assert out["learner/loss"] == pytest.approx(want["learner/loss"], abs=TOL)
    assert out["learner/grad_norm"] == pytest.approx(want["learner/grad_norm"], rel=1e-5)
    assert out["learner/tokens"] == want["learner/tokens"] and out["learner/trees"] == B
    ckpt = load_latest(tmp_path)
    assert ckpt.meta["format"] == 2 and ckpt.meta["ranks"] == 2
    assert set(ckpt.extra) == {"watermark", "step_metrics"} and ckpt.extra["watermark"] == 1
    # the step's metrics, for a restarted learner to report (rank 0 saved them)
    kept = ckpt.extra["step_metrics"]
    assert (kept["learner/version"], kept["learner/batch_index"]) == (1.0, 0.0)
    assert kept["learner/loss"] == out["learner/loss"]
    assert max_diff(full_model_tensors(ckpt), ref.model) <= TOL
    assert {"learner/checkpoint_s", "learner/checkpoint_mb"} <= set(out) and out["learner/checkpoint_mb"] > 0


def test_dcp_checkpoint_resumes_with_one_and_two_ranks_and_exports(ray_cluster, tmp_path, tiny_model_dir):
    from launch.cmd_export import export_checkpoint, find_checkpoint

    cfg = group_cfg(tmp_path)
    ref = reference(tiny_model_dir, cfg)
    first, second = batches(ref.model, ref.tokenizer, 2)
    store = store_with(tmp_path / "store", first + second)
    group = start_group(cfg, tiny_model_dir, store)
    try:
        train(group)  # step 1: checkpoint step_000001 (2 ranks' shards), watermark 1
    finally:
        stop_learner_group(group)
    ref.step(first)
    want = ref.step(second)

    one = reference(tiny_model_dir, cfg)  # 2 ranks → 1: the plain Learner reads the DCP shards
    assert one.restore(tmp_path).step == 1 and one.version == 1
    got = one.step(second)
    assert got["learner/loss"] == pytest.approx(want["learner/loss"], abs=TOL)
    assert max_diff(dict(one.model.state_dict()), ref.model) <= TOL

    group = start_group(cfg, tiny_model_dir, store, resume=True)  # 2 ranks → 2; the store rewinds to 1
    try:
        out = train(group)
    finally:
        stop_learner_group(group)
    assert out["learner/batch_index"] == 1
    assert out["learner/loss"] == pytest.approx(want["learner/loss"], abs=TOL)

    folder = export_checkpoint(find_checkpoint(tmp_path, 2), tmp_path / "hf")
    exported, _ = load_tiny(folder)
    assert max_diff(dict(exported.state_dict()), ref.model) <= TOL
    from learner.forward import token_logprobs
    from learner.packing import pack_trees

    packed = pack_trees(second, concat=True)
    with torch.no_grad():
        a, b = token_logprobs(exported, packed), token_logprobs(ref.model, packed)
    assert float((a - b).abs().max()) <= TOL


def test_a_lost_rank_ends_the_step_naming_it_and_resume_trains_every_batch_once(
    ray_cluster, tmp_path, tiny_model_dir
):
    ray = ray_cluster
    from runtime.learner_group import LearnerRankError

    timeout = 10.0
    cfg = group_cfg(tmp_path, collective_timeout_s=timeout)
    model, tok = load_tiny(tiny_model_dir)
    store = store_with(tmp_path / "store", [t for b in batches(model, tok, 3) for t in b])
    trained = []

    group = start_group(cfg, tiny_model_dir, store)
    try:
        trained.append(train(group)["learner/batch_index"])
        os.kill(ray.get(group.actors[1].host(HostRole.pid)), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(LearnerRankError, match=r"learner rank 1 died") as died:
            train(group)
        assert time.monotonic() - t0 < timeout
        print(died.value)
    finally:
        stop_learner_group(group, timeout_s=5)

    group = start_group(cfg, tiny_model_dir, store, resume=True)
    stopped = None
    try:
        trained.append(train(group)["learner/batch_index"])  # batch 1, handed out again after the rewind
        stopped = ray.get(group.actors[1].host(HostRole.pid))
        os.kill(stopped, signal.SIGSTOP)  # alive but never joins the next collective
        t0 = time.monotonic()
        with pytest.raises(LearnerRankError, match=r"learner rank 1 hung") as hung:
            train(group)
        assert time.monotonic() - t0 < 3 * timeout  # the collective timeout, then the grace for a death
        assert "learner.collective_timeout_s = 10" in str(hung.value)
        print(hung.value)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)  # the test's own stopped process
        stop_learner_group(group, timeout_s=5)

    group = start_group(cfg, tiny_model_dir, store, resume=True)
    try:
        trained.append(train(group)["learner/batch_index"])
        assert group.wait(group.call(LearnerRole.train_step, 0.0)) is None  # all three batches trained
    finally:
        stop_learner_group(group)
    assert trained == [0, 1, 2]
