"""The rollout-tree data model: structure, validation errors, derived views, initialize–expand bookkeeping."""

import numpy as np
import pytest

from system.tree import (
    NodeCredit,
    RolloutTree,
    TreeValidationError,
    check_nonfinite_fraction,
    make_node,
)
from system.tree_build import TreeBuilder, choose_anchors, plan_anchors


def small_tree() -> RolloutTree:
    """root(prompt 1,2,3) → a(5,6 | obs 7) → {b(8) r=1, c(9) r=0};  root → d(4) r=0."""
    b = TreeBuilder("t0", [1, 2, 3], prompt_id="p0")
    a = b.add_turn(0, [5, 6], [-0.1, -0.2], obs_tokens=[7])
    b.set_reward(b.add_turn(a, [8], [-0.3]), 1.0)
    b.set_reward(b.add_turn(a, [9], [-0.4]), 0.0)
    b.set_reward(b.add_turn(0, [4], [-0.5]), 0.0)
    return b.build()


def test_structure_views():
    t = small_tree()
    assert t.leaves.tolist() == [2, 3, 4]
    assert t.num_leaves == 3
    assert t.children == ((1, 4), (2, 3), (), (), ())
    # owner: follow the first-created child; node 1's first child is 2, so leaf 2's sequence trains it.
    assert t.owner_leaf.tolist() == [2, 2, 2, 3, 4]
    assert t.path(3) == [1, 3]
    assert t.turn_parents().tolist() == [-1, 0, 0, -1]
    assert t.leaf_rewards().tolist() == [1.0, 0.0, 0.0]
    # unique tokens: prompt 3 + turn a 2 + obs 1 + b 1 + c 1 + d 1 = 9
    assert t.num_tokens == 9
    assert t.topological_order.tolist() == [0, 1, 2, 3, 4]
    assert t.prompt_tokens.tolist() == [1, 2, 3]


def test_builder_context_is_the_shared_prefix():
    b = TreeBuilder("t", [1, 2])
    a = b.add_turn(0, [3, 4], [-1.0, -1.0], obs_tokens=[5, 6])
    c = b.add_turn(a, [7], [-1.0], obs_tokens=[8])
    assert b.context_tokens(a) == [1, 2, 3, 4, 5, 6]
    assert b.context_tokens(c) == [1, 2, 3, 4, 5, 6, 7, 8]


def nodes_of(tree):
    return list(tree.nodes)


def test_rejects_cycle():
    nodes = nodes_of(small_tree())
    # point node 1 at node 2 (its own child): 1 → 2 → 1 never reaches the root
    nodes[1] = make_node(1, 2, 2, [5, 6], None, [-0.1, -0.2], [7])
    with pytest.raises(TreeValidationError, match="cycle"):
        RolloutTree.build("bad", nodes)


def test_rejects_dangling_parent():
    nodes = nodes_of(small_tree())
    nodes[4] = make_node(4, 17, 1, [4], None, [-0.5], reward=0.0)
    with pytest.raises(TreeValidationError, match="dangling parent 17"):
        RolloutTree.build("bad", nodes)


def test_rejects_several_roots():
    nodes = nodes_of(small_tree())
    nodes[4] = make_node(4, -1, 0, [], reward=None)
    with pytest.raises(TreeValidationError, match=r"exactly one root .* found \[0, 4\]"):
        RolloutTree.build("bad", nodes)


def test_rejects_duplicate_or_gapped_ids():
    nodes = nodes_of(small_tree())
    nodes[3] = make_node(2, 1, 2, [9], None, [-0.4], reward=0.0)
    with pytest.raises(TreeValidationError, match=r"duplicates \[2\]"):
        RolloutTree.build("bad", nodes)


def test_rejects_mismatched_lengths():
    nodes = nodes_of(small_tree())
    nodes[2] = make_node(2, 1, 2, [8, 8], None, [-0.3], reward=1.0)
    with pytest.raises(TreeValidationError, match="same length"):
        RolloutTree.build("bad", nodes)


def test_rejects_leaf_without_reward_and_reward_on_internal_turn():
    nodes = nodes_of(small_tree())
    nodes[2] = make_node(2, 1, 2, [8], None, [-0.3])
    with pytest.raises(TreeValidationError, match="leaf without a finite reward"):
        RolloutTree.build("bad", nodes)
    nodes = nodes_of(small_tree())
    nodes[1] = make_node(1, 0, 1, [5, 6], None, [-0.1, -0.2], [7], reward=1.0)
    with pytest.raises(TreeValidationError, match="only leaves carry a reward"):
        RolloutTree.build("bad", nodes)


def test_rejects_wrong_depth_positive_logprob_and_empty_tree():
    nodes = nodes_of(small_tree())
    nodes[2] = make_node(2, 1, 5, [8], None, [-0.3], reward=1.0)
    with pytest.raises(TreeValidationError, match="depth 5 but its parent has depth 1"):
        RolloutTree.build("bad", nodes)
    nodes = nodes_of(small_tree())
    nodes[2] = make_node(2, 1, 2, [8], None, [0.7], reward=1.0)
    with pytest.raises(TreeValidationError, match="log-prob > 0"):
        RolloutTree.build("bad", nodes)
    with pytest.raises(TreeValidationError, match="no turns"):
        RolloutTree.build("bad", [make_node(0, -1, 0, obs_tokens=[1])])


def test_nonfinite_logprobs_are_dropped_and_counted_not_fatal():
    """docs/algorithm.md §10: a NaN/inf token leaves s_i and ℓ_i; only masked-in tokens count."""
    nodes = nodes_of(small_tree())
    nodes[1] = make_node(1, 0, 1, [5, 6, 6], [1, 1, 0], [np.nan, -0.2, np.inf], [7])
    t = RolloutTree.build("t", nodes)
    # token 0 is a loss token with NaN (counted); token 2 is masked out, its inf does not count
    assert t.nonfinite_tokens == 1
    assert t.effective_mask(1).tolist() == [False, True, False]


def test_nonfinite_fraction_limit():
    check_nonfinite_fraction(1, 100)  # exactly 1% is allowed
    with pytest.raises(FloatingPointError, match="2 of 100 turns"):
        check_nonfinite_fraction(2, 100)


def test_credit_attachment_and_equality():
    t = small_tree()
    n = len(t.nodes)
    credit = NodeCredit(z=np.full(n, np.nan), V=np.zeros(n), q=np.full(n, 0.5), tau=None)
    t2 = t.with_credit(credit)
    assert t2.credit is credit and t.credit is None
    assert not t.equals(t2) and t2.equals(t.with_credit(credit))
    with pytest.raises(TreeValidationError, match="one entry per node"):
        t.with_credit(NodeCredit(np.zeros(2), np.zeros(2), np.zeros(2), 1.0))


def test_choose_anchors_rules():
    rng = np.random.default_rng(0)
    assert choose_anchors(1, 2, rng) == []  # T = 1: no non-terminal boundary
    for _ in range(50):
        a = choose_anchors(6, 2, rng)  # |𝒜| = 5 ≥ N: without replacement
        assert len(set(a)) == 2 and all(1 <= k <= 5 for k in a)
    assert choose_anchors(2, 3, rng) == [1, 1, 1]  # |𝒜| = 1 < N: with replacement, all at boundary 1
    assert choose_anchors(5, 0, rng) == []


def test_plan_anchors_shortfall():
    rng = np.random.default_rng(1)
    skip = plan_anchors([1, 4, 1, 3], 2, rng, "skip")
    assert len(skip) == 4 and {m for m, _ in skip} == {1, 3}
    realloc = plan_anchors([1, 4, 1, 3], 2, np.random.default_rng(1), "reallocate")
    # 2 trajectories with T=1 lose 2 branches each; the 4 go round-robin to trajectories 1 and 3
    assert len(realloc) == 8 and sum(m == 1 for m, _ in realloc) == 4
    assert all(1 <= k < [1, 4, 1, 3][m] for m, k in realloc)
    with pytest.raises(ValueError, match="anchor_shortfall"):
        plan_anchors([2], 1, rng, "drop")


def test_expected_budget_matches_m_times_one_plus_half_n():
    """docs/algorithm.md §2.3/§7.7: anchors uniform on {1..T−1} ⇒ E[(T−k)/T] = 1/2 ⇒ E[cost] = M(1 + N/2)."""
    rng = np.random.default_rng(7)
    for (m, n), expected in {(4, 2): 8.0, (2, 6): 8.0, (2, 2): 4.0, (8, 0): 8.0}.items():
        costs = []
        for _ in range(20000):
            t = int(rng.integers(2, 21))  # T ~ U{2..20}
            costs.append(1 + sum((t - k) / t for k in choose_anchors(t, n, rng)) if n else 1.0)
        # per-trajectory mean cost ≈ 1 + N/2 ; std of the mean over 20k draws is < 0.01
        assert abs(m * np.mean(costs) - expected) < 0.05 * m
