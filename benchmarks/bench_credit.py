"""Credit quality: does a method's per-turn signal single out the turns that made progress?

    treeopsd bench credit --json            # 9 settings x FULL_TREES trees (~6 min on 2 cores)
    treeopsd bench credit --json --quick    # QUICK_TREES trees per setting

On the synthetic KB the environment knows which turns moved the question forward
(`actors/envs/progress.py`: a search that finds the next gold fact of the chain, a right answer). This
benchmark samples real rollout trees with the project's sampler (HF backend, the warm-started tiny model of
`runtime.model_setup.resolve_model`), labels every turn, computes each method's per-turn signal on the
*same* trees, and reports how well each signal ranks progress turns above the others: the Mann–Whitney AUC
(ties half) with a 95% paired bootstrap interval over trees (`system/credit_quality.py`).

Settings: (M, N) in SHAPES x hop counts in HOPS, the same questions (the first trees-per-setting training
questions of that hop count) for every shape. Config overrides per setting: `algo.M`, `algo.N`,
`env.train_hops=[h,h]` and `env.max_turns=max(6, h+1)` (6-hop questions need 7 turns: six searches and
the answer; 2 and 4 hops keep the default 6). The default `env.token_budget` (768) already fits: an oracle
6-hop trajectory is ~300 tokens and even 7 turns of 48 tokens plus 6 observations stay under ~650. Everything
else (ρ = 0.25, uniform backup weights, per-tree τ, temperature 1) is configs/default.yaml.

Signals, per turn i (turn-indexed, node i at index i − 1):

- `treeopsd`: V_i of `system/credit.py:credit_rollout_tree` with the default algo settings (§3);
  `treeopsd_q`: q_i − ½ = V_i/τ_𝒯, the teacher's push (§4). Within a tree the two rank turns alike; pooled
  over trees they differ, because τ depends on the tree's K.
- `grpo`: the leaf advantage z_j = (R_j − R̄)/(sd₁ + 1e-6) over the tree's K leaves, computed by
  `learner/baselines.py:grpo_advantages` with the whole tree as one group, broadcast to every turn that
  leaf's trajectory sampled: turn i gets z of its owner leaf (`RolloutTree.owner_leaf`, §2.4: a trunk turn
  the trunk's leaf, a branch turn its branch's leaf). GSPO uses the same A_j (only its ratio differs), so
  its signal, and its figure, is GRPO's.
- `treepo`: TreePO's per-leaf advantage Â_j of `learner/baselines.py:treepo_advantages` (§8.3, the
  "average" strategy over the tree's prefix groups), broadcast to owner paths like GRPO. We use Â_j before
  the batch whitening of `masked_whiten`: that whitening is one increasing affine map over a rollout batch
  of B trees, so it cannot reorder the turns of a batch, and its batches (which trees share a mean and a
  std) are a training artefact with no counterpart here; Â_j keeps the signal a function of the tree alone.
- `treepo_sum` (a diagnostic): Σ of Â_j over the leaves below turn i, the coefficient TreePO's loss puts on
  a shared turn, which it trains once per descendant leaf (§8.3). It is not a broadcast, so it is reported
  beside, not instead of, `treepo`.

On an unbranched tree ((8, 0)) every turn's subtree is its own leaf, so V_i = z of that leaf: `treeopsd` and
`grpo` coincide there by construction and differ only on the branched shapes.

JSON: pooled figures `credit_auc_<method>` with `_lo`/`_hi`, `treeopsd_minus_grpo` and
`treeopsd_minus_treepo` (paired: every method sees the same tree resamples), counts and base rates. The
pooled AUC compares every progress turn with every other turn, across trees too; `..._within` keeps only
pairs from the same tree (what a learner contrasts). Either way a tree whose rewards are all equal gives
every signal 0 on all its turns and adds only ties (counted half) for every method alike. The same
per shape (`by_shape["4,2"]`), per hop count (`by_hops["6"]`) and per setting (`by_setting["4,2/6"]`).
The pooled bootstrap resamples trees within each setting, a subset's within each of its settings.
Same seed (`run.seed`) → same numbers (seeded sampler and backend, fixed setting order, seeded bootstrap).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SHAPES = ((4, 2), (2, 6), (8, 0))
HOPS = (2, 4, 6)
FULL_TREES, QUICK_TREES = 128, 16  # trees per setting; the full run targets pooled intervals of ±0.03
CHUNK = 8  # questions per sample_trees call: their M trajectories go to the backend in one batch
N_BOOT = 2000
METHODS = ("treeopsd", "treeopsd_q", "grpo", "treepo", "treepo_sum")
DIFFS = (("treeopsd", "grpo"), ("treeopsd", "treepo"))


@dataclass(frozen=True)
class TreeRecord:
    """One labelled tree: its setting, per-turn labels and signals (turn-indexed), its leaf rewards."""

    shape: str  # "M,N"
    hops: int
    labels: np.ndarray
    signals: dict[str, np.ndarray]
    rewards: np.ndarray

    @property
    def setting(self) -> str:
        return f"{self.shape}/{self.hops}"


def _owner_broadcast(tree: Any, leaf_values: np.ndarray) -> np.ndarray:
    """Per turn: the value of its owner leaf; `leaf_values` is aligned with `tree.leaves` (ascending ids)."""
    owner = tree.owner_leaf[1:]
    out: np.ndarray = leaf_values[np.searchsorted(tree.leaves, owner)]
    return out


def _descendant_sum(tree: Any, leaf_values: np.ndarray) -> np.ndarray:
    """Per turn: the sum of `leaf_values` over the leaves below it (itself, for a leaf)."""
    out = np.zeros(len(tree.nodes) - 1)
    for leaf, value in zip(tree.leaves, leaf_values, strict=True):
        out[np.asarray(tree.path(int(leaf))) - 1] += value
    return out


def tree_signals(tree: Any, algo: Any) -> dict[str, np.ndarray]:
    """Every method's per-turn signal on one raw tree (module docstring has the definitions)."""
    import torch

    from learner.baselines import grpo_advantages, treepo_advantages
    from system.credit import credit_rollout_tree

    credit = credit_rollout_tree(tree, algo).credit
    assert credit is not None
    rewards = tree.leaf_rewards()
    one_group = torch.zeros(len(rewards), dtype=torch.long)
    z = grpo_advantages(torch.from_numpy(rewards), one_group).double().numpy()
    leaves, adv = treepo_advantages(tree.turn_parents(), rewards)
    if not np.array_equal(leaves + 1, tree.leaves):  # turn index -> node id; both ascending
        raise AssertionError(f"tree {tree.tree_id}: treepo_advantages leaves differ from the tree's")
    return {
        "treeopsd": credit.V[1:].copy(),
        "treeopsd_q": credit.q[1:] - 0.5,
        "grpo": _owner_broadcast(tree, z),
        "treepo": _owner_broadcast(tree, adv),
        "treepo_sum": _descendant_sum(tree, adv),
    }


def setting_config(base: Any, shape: tuple[int, int], hops: int) -> Any:
    from configs.schema import parse_config, to_dict

    overrides = [f"algo.M={shape[0]}", f"algo.N={shape[1]}", f"env.train_hops=[{hops},{hops}]"]
    overrides.append(f"env.max_turns={max(base.env.max_turns, hops + 1)}")  # hops searches + the answer
    return parse_config(to_dict(base), overrides)


def _sample_hops(
    base: Any, model: str, backend: Any, hops: int, n_trees: int, log: Callable[[str], None]
) -> list[TreeRecord]:
    """All shapes for one hop count: the same questions, one seeded anchor stream per shape."""
    from actors.envs.progress import progress_labels
    from actors.sampler_setup import loop_limits, sampler_parts, tree_shape
    from actors.tree_sampler import TreeSampler

    parts = sampler_parts(setting_config(base, SHAPES[0], hops), model, backend=backend)
    tasks = parts["tasks"][:n_trees]
    records = []
    for shape in SHAPES:
        cfg = setting_config(base, shape, hops)
        parts.update(shape=tree_shape(cfg), limits=loop_limits(cfg))
        sampler = TreeSampler(**{**parts, "rng": np.random.default_rng([cfg.run.seed, hops, *shape])})
        t0 = time.perf_counter()
        for i in range(0, len(tasks), CHUNK):
            chunk = tasks[i : i + CHUNK]
            ids = [f"h{hops}-{shape[0]}x{shape[1]}-{i + j:04d}" for j in range(len(chunk))]
            by_id = {t.task_id: t for t in chunk}
            for tree in sampler.sample_trees(chunk, sampler.rng, ids):
                task = by_id[tree.prompt_id]
                labels = progress_labels(tree, task, parts["env"], parts["chat"].decode_turn)
                signals = tree_signals(tree, cfg.algo)
                key = f"{shape[0]},{shape[1]}"
                records.append(TreeRecord(key, hops, labels, signals, tree.leaf_rewards()))
        mine = [r for r in records if r.shape == f"{shape[0]},{shape[1]}"]
        turns = sum(r.labels.size for r in mine)
        log(
            f"bench credit: {shape[0]},{shape[1]} {hops}-hop: {len(mine)} trees, {turns} turns, "
            f"{time.perf_counter() - t0:.1f} s"
        )
    return records


def collect(
    base: Any,
    model: str,
    backend: Any,
    n_trees: int,
    hops: Sequence[int] = HOPS,
    log: Callable[[str], None] = lambda s: None,
) -> list[TreeRecord]:
    """Labelled trees of every setting, sampled in a fixed order (shapes within hop counts)."""
    return [r for h in hops for r in _sample_hops(base, model, backend, h, n_trees, log)]


def _counts(records: Sequence[TreeRecord]) -> dict[str, Any]:
    labels = np.concatenate([r.labels for r in records])
    rewards = np.concatenate([r.rewards for r in records])
    zero_var = [r for r in records if np.ptp(r.rewards) == 0.0]
    return {
        "trees": len(records),
        "turns": int(labels.size),
        "progress_turns": int(labels.sum()),
        "progress_rate": round(float(labels.mean()), 4),
        "leaf_success_rate": round(float(rewards.mean()), 4),
        "zero_variance_trees": len(zero_var),  # every signal is 0 on all their turns: ties for everyone
    }


def _figures(records: Sequence[TreeRecord], n_boot: int, seed: int) -> dict[str, Any]:
    """AUCs, intervals and paired differences over `records`, resampled within settings."""
    from system.credit_quality import paired_bootstrap

    labels = np.concatenate([r.labels for r in records])
    groups = np.concatenate([np.full(r.labels.size, i) for i, r in enumerate(records)])
    scores = {m: np.concatenate([r.signals[m] for r in records]) for m in METHODS}
    strata = [r.setting for r in records]
    boot = paired_bootstrap(
        scores, labels, groups, strata, n_boot=n_boot, seed=seed, diffs=DIFFS, within=True
    )
    out: dict[str, Any] = {}
    for name, value in boot.items():
        key = name if "_minus_" in name else f"credit_auc_{name}"
        out[key] = None if value is None else round(value, 4)
    return {**out, **_counts(records)}


def summarize(records: Sequence[TreeRecord], n_boot: int = N_BOOT, seed: int = 0) -> dict[str, Any]:
    """The benchmark's JSON (without timing and provenance): pooled, by shape, by hop count, by setting."""

    def subset(pred: Callable[[TreeRecord], bool]) -> dict[str, Any]:
        return _figures([r for r in records if pred(r)], n_boot, seed)

    shapes = sorted({r.shape for r in records}, key=[f"{m},{n}" for m, n in SHAPES].index)
    hops = sorted({r.hops for r in records})
    settings = sorted({(r.shape, r.hops) for r in records}, key=lambda s: (shapes.index(s[0]), s[1]))
    return {
        **_figures(records, n_boot, seed),
        "by_shape": {s: subset(lambda r, s=s: r.shape == s) for s in shapes},
        "by_hops": {str(h): subset(lambda r, h=h: r.hops == h) for h in hops},
        "by_setting": {f"{s}/{h}": subset(lambda r, s=s, h=h: r.setting == f"{s}/{h}") for s, h in settings},
        "n_boot": n_boot,
    }


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from configs.schema import load_config
    from runtime.model_setup import build_policy, resolve_model

    t0 = time.perf_counter()
    quick = bool(getattr(args, "quick", False))
    n_trees = QUICK_TREES if quick else FULL_TREES
    base = load_config(None, ["sampler.backend=hf", "logging.progress=false"])
    model = resolve_model(base, progress=False)  # trains the tiny model on first use (~2 min), then cached
    backend = build_policy(base, model, seed=base.run.seed)
    try:
        records = collect(base, model, backend, n_trees, log=_stderr)
    finally:
        backend.close()
    _stderr(f"bench credit: {len(records)} trees sampled; bootstrap ({N_BOOT} resamples)")
    out = summarize(records, N_BOOT, base.run.seed)
    settings = {"shapes": [f"{m},{n}" for m, n in SHAPES], "hops": list(HOPS), "trees_per_setting": n_trees}
    extra = {"rho": base.algo.rho, "backend": "hf", "model": model, "seed": base.run.seed}
    return {**out, **settings, **extra, "wall_s": round(time.perf_counter() - t0, 1)}
