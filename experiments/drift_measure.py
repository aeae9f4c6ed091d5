"""The real half of the off-policy table (`make offpolicy-table`, docs/algorithm.md §11.1): μ is the learner's
own weights η versions back, at the run's learning rate, on turns with a thinking span of L tokens.

    versions = version_chain(cfg, model, work, 4)     # θ_0 (the warm start) … θ_4 after 4 real learner steps
    cells = measure_length(cfg, versions, L, lags=(1, 2, 4), ...)

π_prox = θ_4. For each L: trees of π_prox itself give the on-policy gradient ḡ_on (the mean over batches); for
each lag η, trees of μ = θ_{4−η} give each mode's batch gradient at θ_4 (the learner's own first mini-batch
gradient, `Learner.step` with an optimizer that records instead of stepping). A cell (L, η) reports per mode
the cosine of every μ batch's gradient to ḡ_on, the relative squared bias ‖E g − E g_on‖² / ‖E g_on‖² (the
unbiased estimator over independent batches), and the batches' measured turn KL. The per-batch gradients
are saved (float16, `work/gradients/`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from configs.schema import Config

GRADIENT_SETTINGS = {"minibatches": 1, "grad_clip": 0.0, "epochs": 1}  # one mini-batch: the first gradient


def unbiased_sq_norm(vectors: np.ndarray) -> float:
    """‖E v‖² from n independent rows v_b: (‖Σ v‖² − Σ ‖v_b‖²) / (n (n − 1)) (may be negative: kept)."""
    n = len(vectors)
    total = vectors.sum(0)
    return float((total @ total - (vectors * vectors).sum()) / (n * (n - 1)))


def with_settings(cfg: Config, section: str, **values: Any) -> Config:
    """`cfg` with fields of one section replaced, unvalidated (the refused modes are measured too)."""
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=values)})


def collect_trees(cfg: Config, model_path: str, n: int, run_dir: Path) -> list[Any]:
    """n credited trees from one in-process sampler of `model_path` (runtime/local.py)."""
    from runtime.local import build_local_run

    # the store admits one batch per learner version, and the version never moves here: one batch of all n
    run_cfg = with_settings(with_settings(cfg, "run", run_dir=str(run_dir)), "learner", batch_trees=n)
    run = build_local_run(run_cfg, model_path)
    try:
        for _ in range(100 * n):
            run.samplers[0].sample_and_commit(cfg.sampler.prompts_per_request)
            run.backup.run_once()
            if (trees := run.store.take_batch(n)) is not None:
                return trees
    finally:
        run.close()
    raise RuntimeError(f"{n} credited trees not sampled in {100 * n} rounds")


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer that records the flattened gradient at each `step` and never moves the weights."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.0})
        self.grads: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double() for p in params]
        self.grads.append(torch.cat(grads))


def batch_gradients(
    cfg: Config, model: Any, trees: Sequence[Any], per_batch: int
) -> tuple[np.ndarray, list[float]]:
    """Per batch of `per_batch` trees, the learner's gradient as a per-tree sum ([n, P] float64), and each
    step's `correction/turn_kl` (nan where the step logs none)."""
    from learner.learner import Learner
    from learner.methods import METHODS

    cfg = with_settings(cfg, "learner", **GRADIENT_SETTINGS)
    recorder = GradientRecorder(model.parameters())
    learner = Learner(model, cfg, optimizer=recorder)
    rows, kl = [], []
    for start in range(0, len(trees) - per_batch + 1, per_batch):
        batch = list(trees[start : start + per_batch])
        recorder.grads.clear()
        stats = learner.step(batch)
        z = METHODS[cfg.algo.method].normalizer(batch, None)  # the step's Z: back to a per-tree sum
        size = sum(p.numel() for p in model.parameters())
        grad = recorder.grads[0] if recorder.grads else torch.zeros(size, dtype=torch.float64)
        rows.append((grad * z / len(batch)).numpy())
        kl.append(float(stats.get("correction/turn_kl", math.nan)))
    return np.stack(rows), kl


def version_chain(cfg: Config, model_path: str, work: Path, steps: int) -> list[str]:
    """θ_0 = `model_path`, then the weights after each of `steps` real learner steps (on-policy, in one
    process, at cfg's learning rate), each saved as a model folder."""
    from runtime.local import build_local_run
    from runtime.model_setup import load_tokenizer

    run = build_local_run(with_settings(cfg, "run", run_dir=str(work / "chain")), model_path)
    folders = [model_path]
    try:
        tok = load_tokenizer(model_path)
        for k in range(1, steps + 1):
            run.step()
            # a folder per version: a checkpoint folder keeps only its newest few (storage/checkpoint.py)
            folders.append(str(run.learner.save(work / "versions" / f"v{k}", k, {}, tok)))
    finally:
        run.close()
    return folders


def cosines(grads: np.ndarray, reference: np.ndarray) -> list[float]:
    norm = float(np.linalg.norm(reference))
    return [float(g @ reference / max(float(np.linalg.norm(g)) * norm, 1e-300)) for g in grads]


def measure_length(
    cfg: Config,
    versions: Sequence[str],
    lags: Sequence[int],
    modes: Sequence[str],
    shape: dict[str, int],
    work: Path,
) -> list[dict[str, Any]]:
    """The cells (L, η) of one thinking length (cfg's env.think_tokens): see the module docstring. shape:
    `batches` and `trees_per_batch`."""
    from transformers import AutoModelForCausalLM

    n, per_batch = shape["batches"] * shape["trees_per_batch"], shape["trees_per_batch"]
    top = len(versions) - 1
    model = AutoModelForCausalLM.from_pretrained(versions[top], local_files_only=True)
    length = cfg.env.think_tokens
    on_trees = collect_trees(cfg, versions[top], n, work / f"L{length}-on")
    on_cfg = with_settings(cfg, "algo", proximal="behavior", rollout_correction="none")
    g_on, _ = batch_gradients(on_cfg, model, on_trees, per_batch)
    reference, scale = g_on.mean(0), unbiased_sq_norm(g_on)
    cells = []
    for eta in lags:
        mu_trees = collect_trees(cfg, versions[top - eta], n, work / f"L{length}-eta{eta}")
        cell: dict[str, Any] = {"name": f"L={length}, η={eta}", "think_tokens": length, "lag": eta}
        cell.update(cosine={}, rel_sq_bias={}, turn_kl_batches=[])
        saved = {"on_policy": g_on.astype(np.float16)}
        for mode in modes:
            mode_cfg = with_settings(cfg, "algo", proximal="step_start", rollout_correction=mode)
            grads, kl = batch_gradients(mode_cfg, model, mu_trees, per_batch)
            cell["cosine"][mode] = cosines(grads, reference)
            cell["rel_sq_bias"][mode] = unbiased_sq_norm(grads - g_on) / scale
            cell["turn_kl_batches"] = kl
            saved[mode] = grads.astype(np.float16)
        cell["turn_kl"] = float(np.nanmean(cell["turn_kl_batches"]))
        cell["tokens_per_turn"] = _tokens_per_turn(mu_trees)
        (work / "gradients").mkdir(parents=True, exist_ok=True)
        np.savez_compressed(work / "gradients" / f"L{length}-eta{eta}.npz", **saved)
        cells.append(cell)
    return cells


def _tokens_per_turn(trees: Sequence[Any]) -> float:
    """Mean sampled tokens per turn over the trees (what L became once sampled)."""
    turns = [int(node.loss_mask.sum()) for t in trees for node in t.nodes[1:]]
    return sum(turns) / max(len(turns), 1)
