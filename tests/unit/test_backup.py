"""The backup role's pure step: node-indexed credit matches the turn-indexed core functions."""

import numpy as np
import pytest

from configs.schema import AlgoConfig
from system.credit import credit_rollout_tree, is_zero_variance, turn_logprob_stats
from system.tree_build import TreeBuilder


def tree_with_rewards(rewards):
    """root → a → {leaf r0, leaf r1};  root → leaf r2  (K = 3)."""
    b = TreeBuilder("t", [1, 2])
    a = b.add_turn(0, [3, 4], [-1.0, -3.0], obs_tokens=[5])
    b.set_reward(b.add_turn(a, [6], [-0.5]), rewards[0])
    b.set_reward(b.add_turn(a, [7, 8], [-0.25, np.nan]), rewards[1])
    b.set_reward(b.add_turn(0, [9], [-2.0]), rewards[2])
    return b.build()


def test_credit_values_by_hand():
    tree = credit_rollout_tree(tree_with_rewards([1.0, 0.0, 0.0]), AlgoConfig(rho=0.1))
    c = tree.credit
    # R = [1,0,0]: mean 1/3, sd₁ = sqrt(((2/3)² + 2·(1/3)²)/2) = sqrt(1/3) = 0.57735
    # z = [(2/3)/0.57735, −(1/3)/0.57735, −(1/3)/0.57735] = [1.1547, −0.57735, −0.57735] (ε = 1e-6 aside)
    sd = np.sqrt(1 / 3) + 1e-6
    z = np.array([2 / 3, -1 / 3, -1 / 3]) / sd
    assert np.isnan(c.z[0]) and np.isnan(c.z[1])
    np.testing.assert_allclose(c.z[2:], z, rtol=1e-12)
    # uniform backup: V_a = (z0 + z1)/2 = (1.1547 − 0.57735)/2 = 0.288675
    np.testing.assert_allclose(c.V[1], (z[0] + z[1]) / 2, rtol=1e-12)
    # τ = (K−1)/(ρ√K) = 2/(0.1·√3) = 11.547 ; q_a = 1/2 + V_a/τ = 0.5 + 0.288675/11.547 = 0.525
    tau = 2 / (0.1 * np.sqrt(3))
    assert c.tau == pytest.approx(tau, rel=1e-12)
    np.testing.assert_allclose(c.q[1], 0.5 + (z[0] + z[1]) / 2 / tau, rtol=1e-12)
    assert np.isnan(c.q[0]) and np.isnan(c.V[0])


def test_logprob_stats_skip_nonfinite_tokens():
    sums, lengths = turn_logprob_stats(tree_with_rewards([1.0, 0.0, 0.0]))
    # turn a: −1 − 3 = −4 over 2 tokens; the second leaf's NaN token is dropped: −0.25 over 1 token
    np.testing.assert_allclose(sums, [-4.0, -0.5, -0.25, -2.0])
    np.testing.assert_allclose(lengths, [2, 1, 1, 1])


def test_zero_variance_tree_gets_half_teacher():
    tree = tree_with_rewards([1.0, 1.0, 1.0])
    assert is_zero_variance(tree)
    c = credit_rollout_tree(tree, AlgoConfig()).credit
    np.testing.assert_array_equal(c.V[1:], 0.0)
    np.testing.assert_array_equal(c.q[1:], 0.5)
    assert not is_zero_variance(tree_with_rewards([1.0, 0.0, 1.0]))


def test_idempotent_and_global_tau():
    tree = tree_with_rewards([0.0, 1.0, 0.0])
    once = credit_rollout_tree(tree, AlgoConfig(rho=0.25))
    assert credit_rollout_tree(once, AlgoConfig(rho=0.25)).credit.equals(once.credit)
    glob = credit_rollout_tree(tree, AlgoConfig(rho=0.25, tau_mode="global"))
    # global τ uses K_nominal = M(1+N) = 12: 11/(0.25·√12) = 12.70, more conservative than K = 3's 4.62
    assert glob.credit.tau == pytest.approx(11 / (0.25 * np.sqrt(12)))
    assert abs(glob.credit.q[1] - 0.5) < abs(once.credit.q[1] - 0.5)
