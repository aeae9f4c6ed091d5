"""Staleness and batch summaries of a fixed rollout batch (pure; logged by the learner's shell).

A tree's version lag is the learner's version when it trains the tree minus the oldest policy version that
sampled any of its turns (the per-path bound counts the oldest behavior policy, as prime-rl does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from system.tree import RolloutTree


def version_lags(trees: Sequence[RolloutTree], learner_version: int) -> np.ndarray:
    return np.array([learner_version - int(t.versions.min()) for t in trees], dtype=np.int64)


def cut_turns(tree: RolloutTree) -> int:
    """Turns cut at the token limit: episodes whose end the sampler recorded as "truncated" (tree.meta
    "finish": leaf node → how its episode ended; each cut turn ends its episode)."""
    finish = json.loads(tree.meta.get("finish", "{}"))
    return sum(reason == "truncated" for reason in finish.values())


def batch_metrics(trees: Sequence[RolloutTree], learner_version: int) -> dict[str, float]:
    lags = version_lags(trees, learner_version)
    turns = sum(len(t.nodes) - 1 for t in trees)
    rewards = np.concatenate([t.leaf_rewards() for t in trees])
    return {
        "store/stale_trees": float((lags > 0).sum()),
        "weights/version_lag": float(lags.mean()),
        "weights/version_lag_max": float(lags.max()),
        "reward/mean": float(rewards.mean()),
        "tree/leaves": float(np.mean([t.num_leaves for t in trees])),
        "tree/depth": float(max(int(n.depth) for t in trees for n in t.nodes)),
        "tree/tokens": float(sum(t.num_tokens for t in trees)),
        # what the samplers generated for the batch (each stored turn once): the budget actually spent
        "tree/sampled_tokens": float(sum(int(n.loss_mask.sum()) for t in trees for n in t.nodes)),
        "tree/truncated_frac": sum(cut_turns(t) for t in trees) / max(turns, 1),  # of the batch's turns
    }


def admission_capacity(eta: int, learner_version: int, batch_size: int, produced: int) -> int:
    """AReaL-style staleness admission (docs/design.md §4): trees a sampler may still start.

    (η + v + 1)·B − produced, where v is the learner's version and `produced` counts trees in the store plus
    outstanding reservations; negative when the learner fell behind. With η versions of lag admitted, a tree
    started now is trained by version v + η at the latest.
    """
    return (eta + learner_version + 1) * batch_size - produced


DRIFT_WARNINGS = (0.3, 1.0)  # turn KL past which the truncated product keeps < 0.9, < 0.65 of its IS mass


def drift_lag(eta: int, turn_kl: float, mean_lag: float, bound: float) -> int:
    """The version lag admission may allow when staleness is bounded by drift (`store.max_turn_kl`), from
    one step's measured turn KL (docs/algorithm.md §11.1).

    A turn's KL grows about linearly with the versions it lags (each step moves π by a similar amount), so
    with d = turn_kl / max(mean_lag, 1) per version the largest lag that keeps the turn KL within `bound` is
    ⌊bound / d⌋, clamped to [0, eta]. Worked: eta 4, turn KL 0.6 at mean lag 2 (d = 0.3), bound 0.5 → 1."""
    per_version = turn_kl / max(mean_lag, 1.0)
    if per_version <= 0:
        return eta
    return max(0, min(eta, int(bound / per_version)))


def drift_warning(turn_kl: float, warned: set[float]) -> str | None:
    """One line the first time a step's turn KL passes each level of DRIFT_WARNINGS (`warned` remembers
    which), naming what to lower; None otherwise."""
    passed = [level for level in DRIFT_WARNINGS if turn_kl > level and level not in warned]
    if not passed:
        return None
    warned.update(passed)
    return (
        f"learner: turn KL {turn_kl:.2f} > {max(passed):g} (μ against π_prox, summed over a turn's tokens): "
        "off-policy weights lose most of their mass here; lower store.eta (the lag admitted), learner.lr "
        "or env.max_turn_tokens, or bound the drift with store.max_turn_kl"
    )
