"""The step's one no-grad scoring pass (learner/learner.py calls it with the log-probs of every micro-batch at
the weights the step starts with), and what it logs, summed over micro-batches and ranks before any ratio:

    algo.behavior_logprobs=recompute   μ := those log-probs (sync runs); learner/mismatch_kl over the turns
                                       the same version sampled
    algo.proximal=step_start           π_prox := those log-probs, the losses' reference beside the stored μ
                                       (docs/algorithm.md §11.1); the metrics below

    mismatch/k1, mismatch/k3              μ against π_prox over every loss token the step trains
    mismatch/k1_lag{ℓ}, k3_lag{ℓ}         the same per version lag ℓ of the token's turn (lag ≥ 8 in lag8+);
    mismatch/tokens_lag{ℓ}                at ℓ = 0 this is the numerical sampler/learner gap, above it the
                                          policy's own change since the turn was sampled plus that gap
    correction/turn_kl                    drift of a turn: the mean over turns of Σ_t k3_t (a turn of L tokens
                                          at per-token KL κ has about L·κ; the product weight's quality is a
                                          function of it alone, docs/algorithm.md §11.1)
    correction/seq_kl                     the same over the PPO-family losses' paths (their IS unit)
    correction/turn_ess                   Kish effective sample size of the correction's weights over the loss
                                          tokens, (Σ w)² / (n Σ w²), token-weighted: 1 when all weigh alike
    correction/weight_mean, weight_max    the rollout correction's IS weight over those tokens
    correction/clipped_token_frac         tokens whose weight the threshold C cut (the *_tis modes)
    correction/masked_token_frac          tokens a mask dropped (weight 0)
    correction/masked_seq_frac            sequences (turns or paths) left with no weight

k1 = log μ − log π_prox (its mean estimates KL(μ ‖ π_prox) and can be negative), k3 = r − 1 − log r with
r = π_prox/μ (≥ 0, lower variance). `learner/mismatch_kl` (and _k3) is the lag-0 value, as without a
proximal policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from configs.algo import AlgoConfig
from learner.diagnostics import mismatch_sums
from learner.methods import owned_turns
from learner.minibatch import correction
from learner.packing import PackedBatch
from learner.rollout_correction import mismatch_by_lag

LAG_BUCKETS = 8  # lags 0..7 have their own series; every lag ≥ 8 shares the last
Scores = Sequence[Sequence[torch.Tensor | None]]  # per mini-batch, per micro-batch (None: a padding pass)
AllRanks = Callable[[Any], list[Any]]


def reference_pass(
    algo: AlgoConfig,
    batches: list[list[PackedBatch]],
    scores: Scores,
    version: int,
    all_ranks: AllRanks,
    stats: dict[str, float],
) -> tuple[list[list[PackedBatch]], ProximalSums | None]:
    """The batches with recomputed μ (`stats` gets its metrics) or with π_prox attached to every scored
    micro-batch, and then the ProximalSums whose `metrics` the step reports once every micro-batch is added:
    a None score is a padding pass, or a pass of the first mini-batch, whose own first forward is π_prox (the
    weights have not moved yet: learner/learner.py attaches it there, one forward saved)."""
    if algo.behavior_logprobs == "recompute":
        return _recompute(batches, scores, version, all_ranks, stats), None
    sums = ProximalSums(algo, version)
    out = [
        [p if lp is None else sums.add(p.with_proximal_logp(lp)) for p, lp in zip(micro, lps, strict=True)]
        for micro, lps in zip(batches, scores, strict=True)
    ]
    return out, sums


def _recompute(
    batches: list[list[PackedBatch]],
    scores: Scores,
    version: int,
    all_ranks: AllRanks,
    stats: dict[str, float],
) -> list[list[PackedBatch]]:
    out, sums = [], [0.0, 0.0, 0.0]
    for micro, lps in zip(batches, scores, strict=True):
        out.append([])
        for packed, logp in zip(micro, lps, strict=True):
            if logp is not None:
                sums = [x + y for x, y in zip(sums, mismatch_sums(packed, logp, version), strict=True)]
                packed = packed.with_behavior_logp(logp)
            out[-1].append(packed)
    k1, k3, n = (sum(part[i] for part in all_ranks(sums)) for i in range(3))
    if n > 0:  # else no turn of the batch was sampled by these weights: nothing measured
        stats.update({"learner/mismatch_kl": k1 / n, "learner/mismatch_kl_k3": k3 / n})
        stats["learner/mismatch_tokens"] = float(n)
    return out


class ProximalSums:
    """Sums of one step's proximal scoring: `add` each scored micro-batch, `metrics` at the end."""

    def __init__(self, algo: AlgoConfig, version: int) -> None:
        self.algo, self.version = algo, version
        self.sums: dict[str, Any] = {"lags": {}, "is": {}, "turns": 0}

    def add(self, packed: PackedBatch) -> PackedBatch:
        """Counts a micro-batch that carries proximal log-probs; returns it (for use in comprehensions)."""
        assert packed.proximal_logp is not None
        on, unit, _ = owned_turns(packed)  # every trained turn once, whatever the method
        lag = (self.version - packed.turn_version.to(unit.device))[unit.clamp(min=0)].clamp(0, LAG_BUCKETS)
        prox, behavior = packed.proximal_logp.flatten(), packed.behavior_logp.flatten()
        self.sums["turns"] += int(torch.unique(unit[on]).numel())  # each turn is owned by one micro-batch
        for value, (k1, k3, n) in mismatch_by_lag(prox, behavior, on, lag).items():
            old = self.sums["lags"].get(str(value), (0.0, 0.0, 0))
            self.sums["lags"][str(value)] = (old[0] + k1, old[1] + k3, old[2] + n)
        _, st = correction(self.algo, packed)
        for key, value in st.items():
            merge = max if key == "is_weight_max" else float.__add__
            self.sums["is"][key] = merge(self.sums["is"].get(key, 0.0), value)
        return packed

    def metrics(self, all_ranks: Callable[[Any], list[Any]] = lambda x: [x]) -> dict[str, float]:
        """The step's scalars; `all_ranks` gathers every rank's sums (the sharded learner's gather_json)."""
        lags: dict[str, list[float]] = {}
        ist: dict[str, float] = {}
        turns = 0
        for part in all_ranks(self.sums):
            turns += part["turns"]
            for key, (k1, k3, n) in part["lags"].items():
                acc = lags.setdefault(key, [0.0, 0.0, 0.0])
                acc[0], acc[1], acc[2] = acc[0] + k1, acc[1] + k3, acc[2] + n
            for key, value in part["is"].items():
                ist[key] = (
                    max(ist.get(key, 0.0), value) if key == "is_weight_max" else ist.get(key, 0.0) + value
                )
        out = {**_mismatch_metrics(lags), **correction_metrics(ist, self.algo.method != "treeopsd")}
        if turns > 0:
            out["correction/turn_kl"] = sum(v[1] for v in lags.values()) / turns
        return out


def _mismatch_metrics(lags: dict[str, list[float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    total = [sum(v[i] for v in lags.values()) for i in range(3)]
    if total[2] > 0:
        out.update({"mismatch/k1": total[0] / total[2], "mismatch/k3": total[1] / total[2]})
        out["mismatch/tokens"] = total[2]
    for key, (k1, k3, n) in lags.items():
        name = f"lag{LAG_BUCKETS}+" if int(key) >= LAG_BUCKETS else f"lag{key}"
        out.update(
            {f"mismatch/k1_{name}": k1 / n, f"mismatch/k3_{name}": k3 / n, f"mismatch/tokens_{name}": n}
        )
    if "0" in lags:  # turns sampled by the weights the learner holds: the numerical gap alone
        k1, k3, n = lags["0"]
        out.update(
            {"learner/mismatch_kl": k1 / n, "learner/mismatch_kl_k3": k3 / n, "learner/mismatch_tokens": n}
        )
    return out


def correction_metrics(st: dict[str, float], paths: bool) -> dict[str, float]:
    """`paths`: the correction's unit is a root-to-leaf path (the PPO-family losses), else a turn."""
    tokens, units = st.get("is_tokens", 0.0), st.get("is_units", 0.0)
    if tokens <= 0:
        return {}
    squares = st["is_weight_sq_sum"]
    out = {"correction/seq_kl": st["is_k3_sum"] / max(units, 1.0)} if paths else {}
    return out | {
        "correction/turn_ess": st["is_weight_sum"] ** 2 / (tokens * squares) if squares > 0 else 0.0,
        "correction/weight_mean": st["is_weight_sum"] / tokens,
        "correction/weight_max": st["is_weight_max"],
        "correction/clipped_token_frac": st["is_clipped_tokens"] / tokens,
        "correction/masked_token_frac": st["is_masked_tokens"] / tokens,
        "correction/masked_seq_frac": st["is_masked_units"] / max(units, 1.0),
    }
