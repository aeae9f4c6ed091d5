"""Hand-worked values for the algorithm options (docs/algorithm.md §5.3, §8.1, §10, §11): depth correction,
GRPO's dual clip, the no-signal counts, the shared sampling distribution and the recompute rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from configs.schema import ConfigError, load_config
from learner.baselines import ppo_clip_loss
from learner.losses import treeopsd_loss
from system.credit import is_zero_variance, no_signal_stats
from system.depth_correction import depth_weights, trunk_lengths
from system.policy import SamplingConfig
from system.sampling import sampling_logprobs
from system.tree_build import TreeBuilder


def chain_tree(tree_id: str, trunk_lens: list[int], branches: list[tuple[int, int, int]], rewards=None):
    """Trunks of the given lengths under the prompt, then branches (trunk m, anchor depth k, length L) hung
    under trunk m's k-th turn (built after every trunk, as the sampler does). Leaves get rewards in order."""
    b = TreeBuilder(tree_id, [1, 2])
    trunk_nodes, parents = [], set()

    def add(parent: int, token: int) -> int:
        parents.add(parent)
        return b.add_turn(parent, [token], [-0.5], obs_tokens=[4])

    for length in trunk_lens:
        node, nodes = 0, []
        for _ in range(length):
            node = add(node, 3)
            nodes.append(node)
        trunk_nodes.append(nodes)
    last = [nodes[-1] for nodes in trunk_nodes]
    for m, k, length in branches:
        node = trunk_nodes[m][k - 1]
        for _ in range(length):
            node = add(node, 5)
        last.append(node)
    leaves = sorted(n for n in last if n not in parents)
    rewards = rewards or [float(i % 2) for i in range(len(leaves))]
    for leaf, r in zip(leaves, rewards, strict=True):
        b.set_reward(leaf, r)
    return b.build()


def test_trunks_follow_the_smallest_child_and_depth_weights_are_hand_worked():
    # Two trunks of 3 turns (nodes 1..3 and 4..6); a branch of 2 turns from trunk 0's turn 1 (depths 2, 3).
    tree = chain_tree("t", [3, 3], [(0, 1, 2)])
    assert trunk_lengths(tree) == [3, 3]
    # cost C = M(1 + N/2) with M = 2, N = 1: 3 trajectories. p_d = 1 for d = 1..3 (both trunks reach 3).
    # n_1 = 2, n_2 = 3, n_3 = 3  ->  w_d = 1·3·p_d / n_d = 3/2, 1, 1.
    (w,) = depth_weights([tree], cost=3.0)
    depth = [n.depth for n in tree.nodes]
    assert [w[i] for i in range(len(w))] == [0.0] + [{1: 1.5, 2: 1.0, 3: 1.0}[d] for d in depth[1:]]


def test_depth_weights_pool_the_batch_and_leave_flat_groups_alone():
    # Flat groups (N = 0, C = M): trunks only, so n_d = M·B·p_d and w ≡ 1.
    flat = [chain_tree("a", [1, 2, 3], []), chain_tree("b", [2, 2, 2], [])]
    for w in depth_weights(flat, cost=3.0):
        assert np.all(w[1:] == 1.0)
    # Batch of two trees, trunks [2, 2] and [1, 3]: p_1 = 1, p_2 = 3/4, p_3 = 1/4 (4 trunks).
    # Tree a also has a branch (0, 1, 2): depths 2, 3. Turn counts: n_1 = 4, n_2 = 3 + 1 = 4, n_3 = 1 + 1 = 2.
    # C = 3 per prompt, B = 2: f_d = 6·p_d = 6, 4.5, 1.5  ->  w = 1.5, 1.125, 0.75.
    a, b = chain_tree("a", [2, 2], [(0, 1, 2)]), chain_tree("b", [1, 3], [])
    wa, wb = depth_weights([a, b], cost=3.0)
    expect = {1: 1.5, 2: 1.125, 3: 0.75}
    for tree, w in ((a, wa), (b, wb)):
        assert all(math.isclose(w[n.node_id], expect[n.depth]) for n in tree.nodes[1:])


def test_turn_weights_multiply_lengths_in_the_sum_and_in_z():
    # Two turns of one token each, s = logp − μ = 0 and 0.5; q = 0.5 and 0.7; weights 2 and 1.
    logp, mu = torch.tensor([0.0, 0.5]), torch.tensor([0.0, 0.0])
    turns, q = torch.tensor([0, 1]), torch.tensor([0.5, 0.7], dtype=torch.float64)
    plain, _ = treeopsd_loss(logp, mu, turns, q)
    weighted, _ = treeopsd_loss(logp, mu, turns, q, turn_weights=torch.tensor([2.0, 1.0]))
    kl0 = 0.0  # q = 1/2 at s = 0: KL = 0
    s = 0.5
    kl1 = 0.7 * math.log(0.7) + 0.3 * math.log(0.3) - 0.7 * math.log(1 / (1 + math.exp(-s)))
    kl1 -= 0.3 * math.log(1 / (1 + math.exp(s)))
    assert math.isclose(float(plain), (kl0 + kl1) / 2, rel_tol=1e-6)  # Σ ℓ KL / Σ ℓ
    assert math.isclose(float(weighted), (2 * kl0 + kl1) / 3, rel_tol=1e-6)  # Σ w ℓ KL / Σ w ℓ


def test_dual_clip_bounds_the_objective_of_negative_advantages():
    # One token, A = −1, ratio r = e^2 ≈ 7.389: PPO-clip objective min(rA, clip(r)A) = −7.389 (the
    # unclipped term is the smaller); the dual clip with c = 3 floors it at c·A = −3: loss 3 instead of 7.389.
    logp, old = torch.tensor([2.0]), torch.tensor([0.0])
    adv, mask = torch.tensor([-1.0]), torch.tensor([True])
    loss, st = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2)
    assert math.isclose(float(loss), math.exp(2.0), rel_tol=1e-6) and st["dual_clip_frac"] == 0.0
    loss, st = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, clip_c=3.0)
    assert math.isclose(float(loss), 3.0, rel_tol=1e-6) and st["dual_clip_frac"] == 1.0
    # A positive advantage is untouched: objective min(7.389, 1.2) = 1.2, loss −1.2 with or without it.
    loss, _ = ppo_clip_loss(logp, old, -adv, mask, 0.2, 0.2, clip_c=3.0)
    assert math.isclose(float(loss), -1.2, rel_tol=1e-6)


def test_no_signal_trees_are_counted():
    signal = chain_tree("s", [2, 2], [(0, 1, 1)], rewards=[1.0, 0.0, 0.0])
    equal = chain_tree("e", [2, 2], [(0, 1, 1)], rewards=[1.0, 1.0, 1.0])
    single = chain_tree("one", [3], [], rewards=[1.0])
    unbranched = chain_tree("u", [1, 1], [], rewards=[0.0, 1.0])
    assert [is_zero_variance(t) for t in (signal, equal, single, unbranched)] == [False, True, True, False]
    # 2 of 4 without signal; 2 of 4 without a branch (single: one chain; unbranched: two one-turn trunks)
    assert no_signal_stats([signal, equal, single, unbranched]) == {
        "learner/no_signal_frac": 0.5,
        "tree/unbranched_frac": 0.5,
    }


def test_sampling_distribution_hand_worked_and_the_sampled_token_kept():
    # logits [2, 1, 0, −1] at T = 1: probs ∝ e^2, e, 1, e^-1 = 0.6439, 0.2369, 0.0871, 0.0321.
    # top-p 0.8: mass before token 1 is 0.6439 < 0.8 (kept), before token 2 is 0.8808 ≥ 0.8 (dropped).
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    lp = sampling_logprobs(logits, SamplingConfig(top_p=0.8))
    z = math.log(math.e**2 + math.e)
    assert torch.allclose(lp[0, :2], torch.tensor([2 - z, 1 - z])) and torch.isinf(lp[0, 2:]).all()
    # With token 3 kept (the learner scoring a sampled token after an update moved it out of the nucleus):
    lp = sampling_logprobs(logits, SamplingConfig(top_p=0.8), keep=torch.tensor([3]))
    z = math.log(math.e**2 + math.e + math.e**-1)
    assert torch.allclose(lp[0, [0, 1, 3]], torch.tensor([2 - z, 1 - z, -1 - z])) and torch.isinf(lp[0, 2])
    # T = 0.5 doubles the logits: log-softmax of [4, 2, 0, −2].
    lp = sampling_logprobs(logits, SamplingConfig(temperature=0.5))
    assert torch.allclose(lp, torch.log_softmax(logits * 2, -1))


def test_recompute_is_refused_in_async_mode_naming_the_key():
    with pytest.raises(
        ConfigError, match=r"^algo\.behavior_logprobs = 'recompute' is invalid: expected 'sampler' in"
    ):
        load_config(overrides=["algo.behavior_logprobs=recompute"])
    assert load_config(overrides=["algo.behavior_logprobs=recompute", "run.mode=sync"]).admission_eta == 0
    with pytest.raises(
        ConfigError, match=r"^algo\.depth_correction = True is invalid: expected false unless"
    ):
        load_config(overrides=["algo.depth_correction=true", "algo.method=grpo"])
