"""The learner: one fixed rollout batch per step, sequential mini-batches, one optimizer step each (no Ray).

Data flow (architecture.md "Data flows one way")::

    take batch ── B credited trees (the caller: store.take_batch)
        │  Learner.step(trees)
        ▼
    select      zero_var_trees=drop (and TreePO's filter_zero_std) drop trees whose leaf rewards are all equal
    advantages  GRPO/GSPO: standardized leaf reward, group = tree;  TreePO: per-leaf Â, whitened over the
                whole batch's path tokens;  TreeOPSD: q from tree.credit (backup actor)
    mini-batch  trees shuffled (seeded by run seed and version) and split into n_mb groups of *whole trees*:
                a tree's turns share prefixes, so the packed forward needs the whole tree in one mini-batch
    μ           stored sampler log-probs, or recomputed here at θ_old (behavior_logprobs=recompute)
    loop        for epoch, mini-batch: forward (tree-packed or path-by-path) → loss → backward → clip → AdamW
        ▼
    publish     version += 1; named_weights() → the weight publisher (the caller)
    log         the returned dict of `learner/...` floats → the metrics sink (the caller)

Run it in-process::

    learner = Learner(model, load_config("configs/default.yaml"))
    stats = learner.step(trees)             # one rollout batch
    weights = learner.named_weights()       # detached CPU copies for the broadcast
    learner.save(run_dir, step, extra={"watermark": w})   # storage.checkpoint

Mismatch (`learner/mismatch_kl`): over the owned loss tokens, the mean of stored − learner log-prob, i.e. the
k1 estimate of KL(μ_sampler ‖ π_learner), and `learner/mismatch_kl_k3` = mean(r − 1 − log r) with
r = π_learner/μ_sampler (k3: non-negative, lower variance). With recompute it covers the whole batch; with
the sampler's log-probs it comes for free from the first mini-batch, whose forward runs at θ_old.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn

from configs.schema import Config
from learner.baselines import grpo_advantages, masked_whiten, treepo_advantages
from learner.forward import token_logprobs
from learner.losses import grpo_loss, gspo_loss, treeopsd_loss, treepo_loss
from learner.packing import PackedBatch, pack_paths, pack_trees
from storage.checkpoint import Checkpoint, load_latest, save_checkpoint
from system.backup import is_zero_variance
from system.tree import RolloutTree, check_nonfinite_fraction


class Learner:
    """Holds the model, AdamW and the policy version; `step` trains on one fixed rollout batch.

    attention="tree" (default): tree-packed trees (or varlen path sequences) in one unpadded row through the
    block-sparse tree attention; "mask": one padded row per tree with the dense 4D float mask through the
    model's own eager/sdpa (path sequences: padded rows, plain causal). `learner.packed_forward` picks trees
    vs root-to-leaf sequences; both give the same losses and gradients up to float rounding.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: Config,
        optimizer: torch.optim.Optimizer | None = None,
        attention: Literal["tree", "mask"] = "tree",
    ):
        self.model, self.cfg, self.attention = model, cfg, attention
        self.optimizer = optimizer or torch.optim.AdamW(
            model.parameters(), lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay
        )
        self.version = 0
        # Dropout off: the first mini-batch then runs exactly at θ_old (s ≡ 0 with recomputed μ).
        self.model.eval()

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        t0 = time.perf_counter()
        kept = self._select(trees)
        stats: dict[str, float] = {
            "learner/trees": float(len(kept)),
            "learner/dropped_trees": float(len(trees) - len(kept)),
        }
        groups = self._split(kept)
        batches = [self._pack(g) for g in groups]
        if self.cfg.algo.behavior_logprobs == "recompute":
            batches = self._recompute(batches, stats)
        self._check_nonfinite(batches)
        adv = self._advantages(groups, batches)
        per_mb: list[dict[str, float]] = []
        for epoch in range(self.cfg.learner.epochs):
            for j, packed in enumerate(batches):
                first = epoch == 0 and j == 0 and self.cfg.algo.behavior_logprobs == "sampler"
                per_mb.append(self._train_minibatch(packed, adv[j], measure_mismatch=first))
        self.version += 1
        stats.update(_summarize(per_mb))
        stats.update({"learner/step_s": time.perf_counter() - t0, "learner/version": float(self.version)})
        return stats

    def _select(self, trees: Sequence[RolloutTree]) -> list[RolloutTree]:
        algo = self.cfg.algo
        if algo.method == "treeopsd" and any(t.credit is None for t in trees):
            raise ValueError("TreeOPSD needs credited trees (tree.credit from the backup actor)")
        drop = algo.zero_var_trees == "drop" or (algo.method == "treepo" and algo.treepo_filter_zero_std)
        return [t for t in trees if not (drop and is_zero_variance(t))]

    def _split(self, trees: list[RolloutTree]) -> list[list[RolloutTree]]:
        """Whole trees per mini-batch; the order depends only on (seed, version): a resumed run repeats it."""
        rng = np.random.default_rng([self.cfg.run.seed, self.version])
        order = rng.permutation(len(trees))
        return [[trees[i] for i in g] for g in np.array_split(order, self.cfg.learner.minibatches) if len(g)]

    def _pack(self, trees: list[RolloutTree]) -> PackedBatch:
        concat = self.attention == "tree"  # no padding when the mask is never materialized
        if self.cfg.learner.packed_forward:
            return pack_trees(trees, concat=concat)
        return pack_paths(trees, full=self.cfg.algo.method != "treeopsd", concat=concat)

    def _recompute(self, batches: list[PackedBatch], stats: dict[str, float]) -> list[PackedBatch]:
        """μ := π_θold at the learner (no grad); reports the sampler/learner mismatch over the whole batch."""
        out, k1, k3, n = [], 0.0, 0.0, 0
        with torch.no_grad():
            for packed in batches:
                logp = token_logprobs(self.model, packed, self.attention).cpu()
                a, b, c = _mismatch(packed, logp)
                k1, k3, n = k1 + a, k3 + b, n + c
                out.append(packed.with_behavior_logp(logp))
        stats["learner/mismatch_kl"] = k1 / max(n, 1)
        stats["learner/mismatch_kl_k3"] = k3 / max(n, 1)
        return out

    def _check_nonfinite(self, batches: list[PackedBatch]) -> None:
        affected = total = 0
        for p in batches:
            on = p.owned & (p.turn_ids >= 0)
            bad = on & ~torch.isfinite(p.behavior_logp)
            total += int(torch.unique(p.turn_ids[on]).numel())
            affected += int(torch.unique(p.turn_ids[bad]).numel())
        check_nonfinite_fraction(affected, total, self.cfg.algo.nonfinite_turn_limit)

    # ---- advantages (baselines) -------------------------------------------------------------------
    def _advantages(self, groups: list[list[RolloutTree]], batches: list[PackedBatch]) -> list:
        """Per-leaf (GRPO/GSPO) or per-pair (TreePO) advantages of each mini-batch; None for TreeOPSD."""
        method = self.cfg.algo.method
        if method == "treeopsd":
            return [None] * len(batches)
        if method in ("grpo", "gspo"):
            # One group per tree: standardized leaf reward (ddof = 1, as verl's GRPO).
            return [grpo_advantages(p.leaf_reward, p.leaf_tree) for p in batches]
        per_pair = []
        for trees, p in zip(groups, batches, strict=True):
            leaf_adv = [treepo_advantages(t.turn_parents(), t.leaf_rewards())[1] for t in trees]
            per_pair.append(torch.from_numpy(np.concatenate(leaf_adv))[p.pair_seq])
        masks = [p.effective_mask.flatten()[p.pair_index] for p in batches]
        # Whitened over every path token of the whole rollout batch (masked_whiten, token level).
        white = masked_whiten(torch.cat(per_pair), torch.cat(masks))
        return list(torch.split(white, [len(a) for a in per_pair]))

    # ---- one mini-batch ---------------------------------------------------------------------------
    def _train_minibatch(self, packed: PackedBatch, adv: torch.Tensor | None, measure_mismatch: bool):
        logp = token_logprobs(self.model, packed, self.attention)
        loss, st = self._loss(packed, logp, adv)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip = self.cfg.learner.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        self.optimizer.step()
        st.update(loss=float(loss.detach()), grad_norm=float(norm), tokens=float(packed.num_tokens))
        st.update(_diagnostics(packed, logp.detach().cpu()))
        if measure_mismatch:
            a, b, n = _mismatch(packed, logp.detach().cpu())
            st.update(mismatch_kl=a / max(n, 1), mismatch_kl_k3=b / max(n, 1))
        return st

    def _loss(self, packed: PackedBatch, logp: torch.Tensor, adv: torch.Tensor | None):
        algo, method = self.cfg.algo, self.cfg.algo.method
        logp = logp.cpu() if logp.device.type != "cpu" else logp
        if method == "treeopsd":
            on = packed.owned & (packed.turn_ids >= 0)
            turn_ids = torch.where(on, packed.turn_ids, -1).flatten()
            loss, _ = treeopsd_loss(logp.flatten(), packed.behavior_logp.flatten(), turn_ids, packed.q)
            return loss, {}
        lp = logp.flatten()[packed.pair_index]
        old = packed.behavior_logp.flatten()[packed.pair_index]
        mask = packed.effective_mask.flatten()[packed.pair_index]
        assert adv is not None
        if method == "grpo":
            loss, st = grpo_loss(lp, old, adv[packed.pair_seq], mask, *algo.grpo_clip)
        elif method == "gspo":
            seq = torch.where(mask, packed.pair_seq, -1)
            loss, st = gspo_loss(lp, old, adv, seq, *algo.gspo_clip)
        else:
            loss, st = treepo_loss(lp, old, adv, mask, *algo.treepo_clip)
        return loss, {"clip_frac": st["clip_frac"]}

    # ---- weights and checkpoints ------------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the parameters (tied weights once, as save_pretrained writes them);
        copies, so a publisher may serialize them while the next step updates the model."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's live state dict (shares storage with the parameters)."""
        return self.model.state_dict()

    def save(self, run_dir: str | Path, step: int, extra: dict | None = None, tokenizer=None) -> Path:
        return save_checkpoint(
            run_dir, step, self.model, self.optimizer, version=self.version, extra=extra, tokenizer=tokenizer
        )

    def restore(self, run_dir: str | Path) -> Checkpoint | None:
        """Loads the newest valid checkpoint into model, optimizer and RNGs; None if there is none."""
        ckpt = load_latest(run_dir)
        if ckpt is not None:
            ckpt.restore(self.model, self.optimizer)
            self.version = ckpt.version
        return ckpt


def _mismatch(packed: PackedBatch, logp: torch.Tensor) -> tuple[float, float, int]:
    """(Σ k1, Σ k3, n) over owned loss tokens with finite μ: k1 = log μ − log π, k3 = r − 1 − log r."""
    on = packed.owned & packed.effective_mask
    d = (logp[on] - packed.behavior_logp[on]).double()  # log r = log π − log μ
    return float((-d).sum()), float((torch.expm1(d) - d).sum()), int(on.sum())


def _diagnostics(packed: PackedBatch, logp: torch.Tensor) -> dict[str, float]:
    """TreeOPSD's per-turn view for every method: mean |s|, overshoot fraction, KL to the teacher."""
    on = packed.owned & (packed.turn_ids >= 0)
    turn_ids = torch.where(on, packed.turn_ids, -1).flatten()
    _, st = treeopsd_loss(logp.flatten(), packed.behavior_logp.flatten(), turn_ids, packed.q)
    keys = ["mean_abs_s", "max_abs_s", "num_tokens", "nonfinite_tokens"]
    if packed.credited:  # relative to a teacher only when there is one (baselines may skip the backup)
        keys += ["overshoot_frac", "kl_to_target"]
    return {k: st[k] for k in keys}


def _summarize(per_mb: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, st in enumerate(per_mb):
        for key in ("loss", "mean_abs_s", "overshoot_frac", "kl_to_target", "grad_norm", "clip_frac"):
            if key in st:
                out[f"learner/mb{k}/{key}"] = st[key]
        for key in ("mismatch_kl", "mismatch_kl_k3"):
            if key in st:
                out[f"learner/{key}"] = st[key]
    if not per_mb:
        return {"learner/loss": 0.0, "learner/grad_norm": 0.0, "learner/tokens": 0.0}
    n_tok = sum(st["num_tokens"] for st in per_mb)
    if all("kl_to_target" in st for st in per_mb):
        kl = sum(st["kl_to_target"] * st["num_tokens"] for st in per_mb) / max(n_tok, 1.0)
        out["learner/kl_to_target"] = kl
    out.update(
        {
            "learner/loss": float(np.mean([st["loss"] for st in per_mb])),
            "learner/grad_norm": float(np.mean([st["grad_norm"] for st in per_mb])),
            "learner/tokens": float(sum(st["tokens"] for st in per_mb)),
            "learner/loss_tokens": float(n_tok),
            "learner/max_abs_s": float(max(st["max_abs_s"] for st in per_mb)),
            "learner/nonfinite_tokens": float(sum(st["nonfinite_tokens"] for st in per_mb)),
        }
    )
    return out
