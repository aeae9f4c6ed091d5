"""`learner/mismatch_kl` measures the sampler/learner gap at equal weights: with the learner's version given,
turns sampled by older weights (async staleness) are left out of it."""

import math

import torch

from learner.diagnostics import mismatch_sums
from learner.packing import pack_tree
from system.tree import RolloutTree, make_node


def two_turn_tree() -> RolloutTree:
    # root prompt, turn 1 sampled by version 0 (2 tokens), turn 2 by version 1 (1 token), leaf reward 1
    nodes = (
        make_node(0, -1, 0, obs_tokens=[5, 6]),
        make_node(1, 0, 1, [7, 8], None, [-1.0, -2.0], policy_version=0),
        make_node(2, 1, 2, [9], None, [-0.5], policy_version=1, reward=1.0),
    )
    return RolloutTree.build("t", nodes)


def test_only_turns_of_the_learners_version_count():
    packed = pack_tree(two_turn_tree())
    logp = packed.behavior_logp.clone()
    stale = (packed.turn_ids == 0) & packed.effective_mask  # turn 1 (version 0): the policy moved since
    logp[stale] -= 0.3  # log π − log μ = −0.3 on its 2 tokens
    logp = torch.nan_to_num(logp, nan=0.0)
    k1, k3, n = mismatch_sums(packed, logp)  # every turn: 3 tokens, k1 = (0.3 + 0.3 + 0) = 0.6
    assert n == 3 and math.isclose(k1, 0.6, rel_tol=1e-6)
    # k3 per stale token = r − 1 − log r with log r = −0.3: e^−0.3 − 1 + 0.3 = 0.040818...
    assert math.isclose(k3, 2 * (math.exp(-0.3) - 0.7), rel_tol=1e-5)
    k1, k3, n = mismatch_sums(packed, logp, version=1)  # only turn 2 (1 token, no gap)
    assert n == 1 and k1 == 0.0 and k3 == 0.0
    k1, k3, n = mismatch_sums(packed, logp, version=0)  # only turn 1 (2 tokens)
    assert n == 2 and math.isclose(k1, 0.6, rel_tol=1e-6)
