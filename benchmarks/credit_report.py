"""Markdown of `bench credit` (written beside bench.md as credit.md by `make bench`): the turn-credit AUC of
each method pooled, per (M, N) and per hop count, with 95% bootstrap intervals, and the verdict on the
paper's mechanism read off the paired interval (no figure typed by hand)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

METHODS = ("treeopsd", "grpo", "treepo")


def _ci(fig: Mapping[str, Any], key: str) -> str:
    value, lo, hi = fig.get(key), fig.get(f"{key}_lo"), fig.get(f"{key}_hi")
    if value is None:
        return "—"
    sign = "+" if "_minus_" in key and value >= 0 else ""
    return f"{sign}{value:.3f} [{lo:.3f}, {hi:.3f}]" if lo is not None else f"{sign}{value:.3f}"


def verdict(fig: Mapping[str, Any], key: str = "treeopsd_minus_grpo") -> str:
    lo, hi = fig.get(f"{key}_lo"), fig.get(f"{key}_hi")
    if lo is None or hi is None:
        return "no interval"
    if lo > 0:
        return "TreeOPSD better (interval above 0)"
    if hi < 0:
        return "TreeOPSD worse (interval below 0)"
    return "within noise (interval contains 0)"


def _row(label: str, fig: Mapping[str, Any]) -> str:
    aucs = " | ".join(_ci(fig, f"credit_auc_{m}") for m in METHODS)
    diff = _ci(fig, "treeopsd_minus_grpo")
    return f"| {label} | {fig.get('trees', '—')} | {aucs} | {diff} | {verdict(fig)} |"


def render(credit: Mapping[str, Any]) -> str:
    head = [
        "# Turn-credit quality (`treeopsd bench credit`)",
        "",
        f"{credit['trees']} rollout trees ({credit['trees_per_setting']} per setting: (M, N) in "
        f"{', '.join(credit['shapes'])} x {', '.join(map(str, credit['hops']))} hops), {credit['turns']} "
        f"turns of which {credit['progress_turns']} made progress; rho {credit['rho']}, seed "
        f"{credit['seed']}, {credit['n_boot']} paired bootstrap resamples over trees. AUC: how well each "
        "method's per-turn signal ranks progress turns above the others (0.5 = chance).",
        "",
        "| trees | n | TreeOPSD V_i | GRPO/GSPO broadcast | TreePO | TreeOPSD − GRPO (paired) | verdict |",
        "|---|---:|---|---|---|---|---|",
        _row("all (pooled)", credit),
    ]
    rows = [_row(f"(M, N) = ({shape})", fig) for shape, fig in credit.get("by_shape", {}).items()]
    rows += [_row(f"{hops}-hop questions", fig) for hops, fig in credit.get("by_hops", {}).items()]
    within = credit.get("treeopsd_minus_grpo_within")
    tail = [""]
    if within is not None:
        tail.append(
            "Within trees only (pairs of turns of the same tree, what a learner contrasts): TreeOPSD − GRPO "
            f"{_ci(credit, 'treeopsd_minus_grpo_within')}, {verdict(credit, 'treeopsd_minus_grpo_within')}."
        )
    return "\n".join(head + rows + tail) + "\n"
