"""The report's figures: which panels `treeopsd report` draws and which tags each reads (storage/report.py
draws them). Pure data plus the mini-batch figure built from the indices a run logged."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Scalars = Mapping[str, Sequence[tuple[int, float]]]

STEP_LABEL = "learner step"
_MB_TAG = re.compile(r"^learner/mb(\d+)/")


@dataclass(frozen=True)
class Panel:
    """One subplot: `lines` are (tag, legend label); `ylim` pins the y range (ratios live in [0, 1])."""

    title: str
    ylabel: str
    lines: tuple[tuple[str, str], ...]
    ylim: tuple[float, float] | None = None
    wanted: str = ""  # what the "no data" note names; defaults to the tags
    integer_y: bool = False  # counts (trees, versions): whole-number ticks

    def missing_note(self) -> str:
        return "no data\n(" + (self.wanted or ", ".join(tag for tag, _ in self.lines)) + ")"


@dataclass(frozen=True)
class FigureSpec:
    name: str  # file stem
    title: str
    ncols: int
    panels: tuple[Panel, ...] = field(default_factory=tuple)
    shared_legend: bool = False  # one legend under the figure instead of one per panel (same lines in each)


def minibatch_indices(scalars: Scalars) -> list[int]:
    """The mini-batch indices k that have any `learner/mb{k}/...` series, sorted."""
    return sorted({int(m.group(1)) for tag in scalars if (m := _MB_TAG.match(tag))})


def _ratio(lo: float = 0.0, hi: float = 1.0) -> tuple[float, float]:
    return (lo - 0.03 * (hi - lo), hi + 0.03 * (hi - lo))


_FIXED_FIGURES = (
    FigureSpec(
        "reward",
        "Reward and success",
        2,
        (
            Panel("Reward (mean leaf reward per batch)", "reward", (("reward/mean", "reward/mean"),)),
            Panel(
                "Evaluation success",
                "success rate",
                (("eval/success", "eval/success"), ("demo/success", "eval before / after training")),
                ylim=_ratio(),
                wanted="eval/success",
            ),
        ),
    ),
    FigureSpec(
        "staleness",
        "Staleness",
        3,
        (
            Panel(
                "Version lag of trained trees",
                "policy versions behind",
                (("weights/version_lag", "mean"), ("weights/version_lag_max", "max")),
                integer_y=True,
            ),
            Panel(
                "Stale trees per batch",
                "trees (lag > 0)",
                (("store/stale_trees", "store/stale_trees"),),
                integer_y=True,
            ),
            Panel(
                "Trees pending in the store",
                "trees (raw + credited)",
                (("store/trees_pending", "store/trees_pending"),),
                integer_y=True,
            ),
        ),
    ),
    FigureSpec(
        "mismatch",
        "Sampler/learner mismatch and rollout correction (algo.proximal=step_start)",
        3,
        (
            Panel(
                "Mismatch μ vs π_prox (k3) by version lag",
                "k3 = mean(r − 1 − log r)",
                (("mismatch/k3", "all turns"), *((f"mismatch/k3_lag{k}", f"lag {k}") for k in range(5))),
                wanted="mismatch/k3, mismatch/k3_lag{ℓ}",
            ),
            Panel(
                "Mismatch μ vs π_prox (k1)",
                "k1 = mean(log μ − log π_prox)",
                (("mismatch/k1", "all turns"), ("learner/mismatch_kl", "lag 0 (numerical gap)")),
            ),
            Panel(
                "Importance weight",
                "π_prox/μ after the correction",
                (("correction/weight_mean", "mean"), ("correction/weight_max", "max")),
            ),
            Panel(
                "Clipped and masked by the correction",
                "fraction",
                (
                    ("correction/clipped_token_frac", "tokens clipped at C"),
                    ("correction/masked_token_frac", "tokens masked"),
                    ("correction/masked_seq_frac", "sequences masked"),
                ),
                _ratio(0.0, 0.0),
            ),
            Panel(
                "Turns cut at the token limit",
                "fraction of turns",
                (("tree/truncated_frac", "per batch"), ("sampler/truncated_frac", "per sampler call")),
                _ratio(0.0, 0.0),
            ),
        ),
    ),
    FigureSpec(
        "throughput",
        "Throughput per role",
        3,
        (
            Panel("Sampler: tokens per second", "tokens / s", (("sampler/tokens_per_s", "samplers (mean)"),)),
            Panel("Sampler: idle ratio", "idle fraction", (("sampler/idle_ratio", "samplers"),), _ratio()),
            Panel(
                "Sampler: wait for weights",
                "seconds",
                (("sampler/wait_for_weights_s", "samplers"),),
            ),
            Panel("Learner: step time", "seconds per step", (("learner/step_s", "learner"),)),
            Panel("Learner: idle ratio", "idle fraction", (("learner/idle_ratio", "learner"),), _ratio()),
            Panel("Learner: wait for a batch", "seconds", (("learner/wait_for_batch_s", "learner"),)),
        ),
    ),
)


def figure_specs(scalars: Scalars) -> tuple[FigureSpec, ...]:
    """The four figures; the mini-batch panels get one line per k found in `scalars`."""
    return (*_FIXED_FIGURES, _minibatch_figure(minibatch_indices(scalars)))


def _minibatch_figure(ks: list[int]) -> FigureSpec:
    def per_mb(key: str) -> tuple[tuple[str, str], ...]:
        return tuple((f"learner/mb{k}/{key}", f"mini-batch {k}") for k in ks)

    return FigureSpec(
        "minibatches",
        "Per mini-batch index k",
        2,
        (
            Panel(
                "Loss per mini-batch",
                "loss",
                (*per_mb("loss"), ("learner/loss", "all mini-batches")),
                wanted="learner/mb{k}/loss",
            ),
            Panel(
                "Overshoot fraction per mini-batch",
                "fraction of turns past target",
                per_mb("overshoot_frac"),
                (0.0, 0.0),  # from 0, but not stretched to 1: overshoot is usually a few percent
                wanted="learner/mb{k}/overshoot_frac",
            ),
            Panel(
                "Mean |s| per mini-batch",
                "mean |s|",
                per_mb("mean_abs_s"),
                wanted="learner/mb{k}/mean_abs_s",
            ),
            Panel(
                "KL to target per mini-batch",
                "KL (token-weighted)",
                (*per_mb("kl_to_target"), ("learner/kl_to_target", "all mini-batches")),
                wanted="learner/mb{k}/kl_to_target",
            ),
        ),
        shared_legend=True,
    )


FIGURES = ("reward", "staleness", "mismatch", "throughput", "minibatches")

KEY_METRICS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward per batch"),
    ("eval/success", "evaluation success"),
    ("learner/loss", "loss"),
    ("learner/kl_to_target", "KL to target"),
    ("weights/version_lag", "version lag (mean)"),
    ("weights/version_lag_max", "version lag (max)"),
    ("store/stale_trees", "stale trees per batch"),
    ("store/trees_pending", "trees pending"),
    ("sampler/tokens_per_s", "sampler tokens/s"),
    ("sampler/idle_ratio", "sampler idle ratio"),
    ("learner/step_s", "learner step seconds"),
    ("learner/idle_ratio", "learner idle ratio"),
    ("learner/wait_for_batch_s", "learner wait for batch (s)"),
    ("backup/trees", "trees credited by backup"),
    ("tree/leaves", "leaves per tree"),
)
