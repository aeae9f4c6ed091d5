"""The backup role's pure computation: a raw RolloutTree in, the same tree with z, V, τ, q attached out.

Maps the tree's node ids to the turn-indexed arrays of `system.teacher.credit_tree` (node i ↔ turn i−1;
the root is not a turn and gets NaN), so the math stays in one place. Turn log-prob sums and lengths (for
the likelihood backup weights) use only finite, loss-masked behavior log-probs (algorithm.md §10).
"""

from __future__ import annotations

import numpy as np

from configs.schema import AlgoConfig
from system.teacher import credit_tree
from system.tree import NodeCredit, RolloutTree


def turn_logprob_stats(tree: RolloutTree) -> tuple[np.ndarray, np.ndarray]:
    """(Σ_t log μ(y_t), ℓ) per turn over finite loss tokens, turn-indexed."""
    sums, lengths = [], []
    for n in tree.nodes[1:]:
        m = tree.effective_mask(n.node_id)
        sums.append(float(n.behavior_logprobs[m].astype(np.float64).sum()))
        lengths.append(int(m.sum()))
    return np.array(sums), np.array(lengths, dtype=np.float64)


def credit_rollout_tree(tree: RolloutTree, algo: AlgoConfig) -> RolloutTree:
    """Attaches NodeCredit; idempotent (a tree that already has credit is recomputed identically)."""
    rewards = np.array([n.reward for n in tree.nodes[1:]], dtype=np.float64)
    sums, lengths = turn_logprob_stats(tree)
    c = credit_tree(
        tree.turn_parents(),
        rewards,
        algo.rho,
        weights=algo.backup_weights,
        teacher=algo.teacher,
        tau_mode=algo.tau_mode,
        k_nominal=algo.nominal_leaves if algo.tau_mode == "global" else None,
        credit=algo.credit,
        turn_logprob_sums=sums,
        turn_lengths=lengths,
    )

    def with_root(a: np.ndarray) -> np.ndarray:
        return np.concatenate([[np.nan], a])

    return tree.with_credit(NodeCredit(z=with_root(c.z), V=with_root(c.V), q=with_root(c.q), tau=c.tau))


def is_zero_variance(tree: RolloutTree) -> bool:
    """All K rewards equal (or K < 2): V ≡ 0, q ≡ 1/2 — `zero_var_trees = drop` removes such trees."""
    r = tree.leaf_rewards()
    return len(r) < 2 or float(np.ptp(r)) == 0.0
