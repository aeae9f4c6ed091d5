"""The learner step (learner/learner.py) and checkpoints (storage/checkpoint.py) on the tiny Qwen2 model."""

import dataclasses
import random
import warnings

import numpy as np
import pytest
import torch
from learner_fixtures import config, flat_params, make_trees, on_policy
from transformers import AutoModelForCausalLM

from actors.policy.tiny_model import build_tiny_model
from learner.forward import token_logprobs
from learner.learner import Learner
from learner.packing import pack_tree
from storage.checkpoint import load_latest
from system.tree import RolloutTree

torch.set_num_threads(1)


def turn_s(model, tree: RolloutTree) -> tuple[np.ndarray, np.ndarray]:
    """(s_i, log r*_i) for the turns of `tree` with loss tokens."""
    p = pack_tree(tree)
    with torch.no_grad():
        lp = token_logprobs(model, p)[0]
    on = p.turn_ids[0] >= 0
    ids = p.turn_ids[0][on]
    d = (lp[on] - p.behavior_logp[0][on]).double()
    n = len(tree.nodes) - 1
    ell = torch.zeros(n, dtype=torch.float64).index_add(0, ids, torch.ones_like(d))
    s = torch.zeros(n, dtype=torch.float64).index_add(0, ids, d) / ell.clamp(min=1)
    q = tree.credit.q[1:]
    keep = ell.numpy() > 0
    return s.numpy()[keep], np.log(q / (1 - q))[keep]


def test_step_moves_s_toward_the_target_and_lowers_the_loss(tok):
    model = build_tiny_model(tok, seed=1)
    trees = on_policy(model, make_trees(tok, n=2, seed=3))
    # s against the fixed μ across steps (proximal = behavior): with the step-start reference every step
    # would start again from s = 0
    learner = Learner(model, config(learner={"minibatches": 1}, algo={"proximal": "behavior"}))
    before = flat_params(model)
    kls = [learner.step(trees)["learner/mb0/kl_to_target"]]
    assert not torch.equal(before, flat_params(model)) and learner.version == 1
    for _ in range(14):
        kls.append(learner.step(trees)["learner/mb0/kl_to_target"])
    # mb0's KL is measured before each update: it falls as s_i approaches log r*_i (the unique minimizer)
    assert kls[-1] < 0.3 * kls[0], kls
    gaps0, gaps1, agree = [], [], []
    for tree in trees:
        s, target = turn_s(model, tree)
        big = np.abs(target) > 0.05
        gaps0.append(np.abs(target[big]))  # s = 0 at the start
        gaps1.append(np.abs(s[big] - target[big]))
        agree.append(np.sign(s[big]) == np.sign(target[big]))
    assert np.mean(np.concatenate(gaps1)) < 0.5 * np.mean(np.concatenate(gaps0))
    assert np.mean(np.concatenate(agree)) > 0.8


@pytest.mark.parametrize("clip", [1e-3, 0.0])
def test_grad_clipping_bounds_the_update(tok, clip):
    model = build_tiny_model(tok, seed=2)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # update = −(clipped) gradient
    # random μ (not the model's): proximal = behavior, so no importance weight shrinks the gradient
    cfg = config(learner={"minibatches": 1, "grad_clip": clip}, algo={"proximal": "behavior"})
    learner = Learner(model, cfg, optimizer=sgd)
    before = flat_params(model)
    stats = learner.step(make_trees(tok, seed=4))
    moved = float((flat_params(model) - before).norm())
    assert stats["learner/grad_norm"] > 1e-2  # reported before clipping
    expected = clip if clip > 0 else stats["learner/grad_norm"]
    assert moved == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("method", ["treeopsd", "grpo", "gspo", "treepo"])
def test_each_method_steps_with_finite_stats_and_packed_equals_paths(tok, method):
    trees = make_trees(tok, n=4, seed=5)
    results = []
    for packed in (True, False):
        model = build_tiny_model(tok, seed=3)
        cfg = config(algo={"method": method}, learner={"packed_forward": packed})
        # SGD: the update is linear in the gradient (Adam would blow float noise on ~0 gradients up to ±lr)
        stats = Learner(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).step(trees)
        assert all(np.isfinite(v) for v in stats.values()), stats
        for key in ("loss", "mean_abs_s", "overshoot_frac"):
            assert f"learner/mb0/{key}" in stats and f"learner/mb1/{key}" in stats
        for key in ("loss", "grad_norm", "tokens", "step_s", "kl_to_target", "mismatch_kl"):
            assert f"learner/{key}" in stats
        results.append((stats, flat_params(model)))
    (packed, w_packed), (paths, w_paths) = results
    assert packed["learner/tokens"] < paths["learner/tokens"]  # shared prefixes forwarded once
    for k in ("learner/mb0/loss", "learner/mb1/loss", "learner/mb0/grad_norm"):
        assert packed[k] == pytest.approx(paths[k], rel=1e-4, abs=1e-6)
    torch.testing.assert_close(w_packed, w_paths, atol=1e-6, rtol=0)


def test_zero_variance_trees_are_dropped_only_when_asked(tok):
    trees = make_trees(tok, n=3, seed=6)
    flat = make_trees(tok, n=1, seed=7, reward_p=0.0)  # every leaf reward 0
    for mode, kept in (("drop", 3), ("keep", 4)):
        stats = Learner(build_tiny_model(tok), config(algo={"zero_var_trees": mode})).step([*trees, *flat])
        assert stats["learner/trees"] == kept
        assert stats["learner/dropped_trees"] == 4 - kept
    learner = Learner(build_tiny_model(tok), config(algo={"zero_var_trees": "drop"}))
    before = flat_params(learner.model)
    stats = learner.step(flat)  # nothing left to train: no update, but the batch is consumed
    assert stats["learner/trees"] == 0 and stats["learner/loss"] == 0.0 and learner.version == 1
    assert torch.equal(before, flat_params(learner.model))


def test_recompute_makes_the_first_minibatch_on_policy(tok):
    model = build_tiny_model(tok, seed=4)
    trees = make_trees(tok, seed=8)
    recompute = config(algo={"behavior_logprobs": "recompute"}, run={"mode": "sync"})  # μ = θ_old needs sync
    stats = Learner(model, recompute).step(trees)
    assert stats["learner/mb0/mean_abs_s"] == 0.0  # μ recomputed at θ_old: s ≡ 0 before the first update
    assert stats["learner/mismatch_kl"] > 0.1 and stats["learner/mismatch_kl_k3"] > 0  # random stored μ
    model2 = build_tiny_model(tok, seed=4)
    sampler = Learner(model2, config()).step(on_policy(model2, trees))
    assert abs(sampler["learner/mismatch_kl"]) < 1e-5 and sampler["learner/mb0/mean_abs_s"] < 1e-5


def test_too_many_nonfinite_behavior_logprobs_fail_loudly(tok):
    tree = make_trees(tok, n=1, seed=9)[0]
    trained = [k for k, n in enumerate(tree.nodes) if n.loss_mask.any()]  # the turns the learner counts
    total = len(trained)
    assert total >= 2, total

    def with_nan(turns) -> RolloutTree:
        nodes = [
            dataclasses.replace(n, behavior_logprobs=np.full_like(n.behavior_logprobs, np.nan))
            if k in turns
            else n
            for k, n in enumerate(tree.nodes)
        ]
        return RolloutTree.build(tree.tree_id, nodes, credit=tree.credit)

    every = rf"^{total} of {total} turns have non-finite log-probs \(> 1%\)"
    with pytest.raises(FloatingPointError, match=every):
        Learner(build_tiny_model(tok), config()).step([with_nan(trained)])
    one = with_nan(trained[:1])  # 1 of `total` turns: exactly at a limit of 1 / total (not over) ...
    stats = Learner(build_tiny_model(tok), config(algo={"nonfinite_turn_limit": 1 / total})).step([one])
    assert np.isfinite(stats["learner/loss"])  # ... it is dropped from the loss and the step goes on
    below = config(algo={"nonfinite_turn_limit": 0.999 / total})  # ... just below it, the step fails
    with pytest.raises(FloatingPointError, match=rf"^1 of {total} turns have non-finite log-probs"):
        Learner(build_tiny_model(tok), below).step([one])


def test_named_weights_are_detached_cpu_copies(tok):
    learner = Learner(build_tiny_model(tok), config())
    w = learner.named_weights()
    assert set(w) == {n for n, _ in learner.model.named_parameters()}
    name, p = next(iter(learner.model.named_parameters()))
    assert w[name].device.type == "cpu" and not w[name].requires_grad
    assert w[name].data_ptr() != p.data_ptr() and torch.equal(w[name], p.detach())


def rng_draws():
    return random.random(), float(np.random.random()), float(torch.rand(()))


def test_checkpoint_roundtrip_resume_and_fallback(tok, tmp_path):
    trees, trees2 = make_trees(tok, seed=10), make_trees(tok, seed=11)
    a = Learner(build_tiny_model(tok, seed=5), config())
    a.step(trees)
    path = a.save(tmp_path, step=1, extra={"watermark": 7}, tokenizer=tok)
    after_save = rng_draws()
    a.step(trees2)  # the run continues from here ...

    b = Learner(build_tiny_model(tok, seed=6), config())  # ... and a restarted learner resumes
    rng_draws()
    ckpt = b.restore(tmp_path)
    assert ckpt is not None and ckpt.path == path and ckpt.step == 1 and ckpt.extra == {"watermark": 7}
    assert b.version == 1 and rng_draws() == after_save
    b.step(trees2)
    assert torch.equal(flat_params(a.model), flat_params(b.model))  # exact resume: same mini-batches too
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for pid, entry in sa["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, sb["state"][pid][key]), key

    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    ref = Learner(build_tiny_model(tok, seed=7), config())
    ref.restore(tmp_path)
    torch.testing.assert_close(flat_params(hf), flat_params(ref.model), atol=0, rtol=0)

    b.save(tmp_path, step=2)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"
    shard = next((tmp_path / "checkpoints" / "step_000002").glob("model*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"garbage!")  # same size, different bytes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = load_latest(tmp_path)
    assert latest is not None and latest.step == 1
    assert any("step_000002" in str(w.message) for w in caught)
    (tmp_path / "checkpoints" / "step_000001" / "meta.json").unlink()  # a torn directory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_latest(tmp_path) is None


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_p": 0.9}])
def test_chunked_lm_head_trains_the_same_step(tok, sampling):
    """`learner.logprob_chunk_tokens` = 5 (every micro-batch's loss tokens in many chunks, recomputed in
    backward) against 0 (the whole [n, V] at once): the same losses and the same update (SGD: linear in the
    gradient), at the sampling distribution the trees were drawn from."""
    trees = make_trees(tok, n=3, seed=8)
    results = []
    for chunk in (0, 5):
        model = build_tiny_model(tok, seed=4)
        cfg = config(
            sampler=sampling, learner={"logprob_chunk_tokens": chunk, "max_tokens_per_microbatch": 40}
        )
        stats = Learner(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).step(trees)
        results.append((stats, flat_params(model)))
    (whole, w_whole), (chunked, w_chunked) = results
    assert chunked["learner/microbatches"] == whole["learner/microbatches"] >= 2
    for k in ("learner/mb0/loss", "learner/mb1/loss", "learner/mb0/grad_norm"):
        assert chunked[k] == pytest.approx(whole[k], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(w_chunked, w_whole, atol=1e-7, rtol=0)
