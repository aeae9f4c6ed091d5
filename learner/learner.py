"""The learner role: one fixed rollout batch per step, sequential mini-batches, one optimizer step each
(no Ray; on Ray, learner/learner_actor.py is this class plus a few methods).

Data flow (docs/design.md §1)::

    train_step  take batch ── B credited trees (store.take_batch, recorded as batch k = store.watermark())
        │  step(trees)
        ▼
    select      zero_var_trees=drop (and TreePO's filter_zero_std) drop trees whose leaf rewards are all equal
    advantages  GRPO/GSPO: standardized leaf reward, group = tree;  TreePO: per-leaf Â, whitened over the
                whole batch's path tokens;  TreeOPSD: q from tree.credit (backup actor)
    mini-batch  trees shuffled (seeded by run seed and version) and split into n_mb groups of *whole trees*:
                a tree's turns share prefixes, so the packed forward needs the whole tree in one mini-batch
    μ           stored sampler log-probs, or recomputed here at θ_old (behavior_logprobs=recompute)
    loop        for epoch, mini-batch: forward (tree-packed or path-by-path) → loss → backward → clip → AdamW
        ▼
    publish     version += 1; named_weights() → the weight source; the store learns the new version
    checkpoint  every `learner.checkpoint_every` steps: weights, optimizer, RNG, version and the watermark
    log         the returned dict of `learner/...` floats → the metrics sink (the caller)

The step count is the version: one step, one version (a resumed run restores it with the checkpoint).
Run it in-process::

    learner = Learner(model, cfg, store=store, weights=channel)
    learner.start(resume=False)             # publishes version 0 (or restores the newest checkpoint)
    stats = learner.train_step()            # None until B credited trees wait in the store
    stats = learner.step(trees)             # the training part alone, on any trees

Mismatch (`learner/mismatch_kl`): over the owned loss tokens, the mean of stored − learner log-prob, i.e. the
k1 estimate of KL(μ_sampler ‖ π_learner), and `learner/mismatch_kl_k3` = mean(r − 1 − log r) with
r = π_learner/μ_sampler (k3: non-negative, lower variance). With recompute it covers the whole batch; with
the sampler's log-probs it comes for free from the first mini-batch, whose forward runs at θ_old.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from configs.schema import Config
from learner.baselines import grpo_advantages, masked_whiten, treepo_advantages
from learner.diagnostics import mismatch_sums, summarize_minibatches, turn_diagnostics
from learner.forward import token_logprobs
from learner.losses import grpo_loss, gspo_loss, treeopsd_loss, treepo_loss
from learner.packing import PackedBatch, pack_paths, pack_trees
from storage.checkpoint import Checkpoint, load_latest, save_checkpoint
from system.credit import is_zero_variance
from system.interfaces import StoreClient, WeightSource
from system.staleness import batch_metrics, version_lags
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
        *,
        store: StoreClient | None = None,
        weights: WeightSource | None = None,
        tokenizer: Any = None,
    ):
        self.model, self.cfg, self.attention = model, cfg, attention
        self.store, self.weights, self.tokenizer = store, weights, tokenizer
        self.optimizer = optimizer or torch.optim.AdamW(
            model.parameters(), lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay
        )
        self.version = 0
        self.wait_s = 0.0
        self.lag_history: list[int] = []  # per-tree version lags since the last pop, for the histogram
        # Dropout off: the first mini-batch then runs exactly at θ_old (s ≡ 0 with recomputed μ).
        self.model.eval()

    # ---- the role ---------------------------------------------------------------------------------
    def start(self, resume: bool = False) -> Checkpoint | None:
        """Restores the newest checkpoint when resuming (and rewinds the store to its watermark, so no batch
        is trained twice and none skipped), then publishes the current weights."""
        ckpt = self.restore(self.cfg.run.run_dir) if resume else None
        if ckpt is not None and self.store is not None:
            self.store.rewind_to(int(ckpt.extra["watermark"]))
        self._publish()
        return ckpt

    def train_step(self, idle_sleep_s: float = 0.0) -> dict[str, float] | None:
        """Take a batch → train → publish → checkpoint. None (after `idle_sleep_s`) when B credited trees are
        not there yet."""
        assert self.store is not None, "train_step needs a store (Learner(..., store=...))"
        t0 = time.perf_counter()
        batch_index = self.store.watermark()  # the id take_batch records this batch under
        trees = self.store.take_batch(self.cfg.learner.batch_trees)
        if trees is None:
            time.sleep(idle_sleep_s)  # back off instead of spinning a remote store
            self.wait_s += time.perf_counter() - t0
            return None
        self.lag_history.extend(version_lags(trees, self.version).tolist())
        metrics = {**batch_metrics(trees, self.version), **self.step(trees)}
        metrics["weights/publish_s"] = self._publish()
        if self.version % self.cfg.learner.checkpoint_every == 0:
            self.save(self.cfg.run.run_dir)
        busy = time.perf_counter() - t0
        metrics.update({"learner/wait_for_batch_s": self.wait_s, "learner/batch_index": float(batch_index)})
        metrics["learner/idle_ratio"] = self.wait_s / max(self.wait_s + busy, 1e-9)
        metrics["learner/step"] = float(self.version)
        self.wait_s = 0.0
        return metrics

    def _publish(self) -> float:
        t0 = time.perf_counter()
        if self.weights is not None:
            self.weights.publish(self.named_weights(), self.version)
        if self.store is not None:
            self.store.set_learner_version(self.version)
        return time.perf_counter() - t0

    def pop_lags(self) -> list[int]:
        lags, self.lag_history = self.lag_history, []
        return lags

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
        stats.update(summarize_minibatches(per_mb))
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
                a, b, c = mismatch_sums(packed, logp)
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
        st.update(turn_diagnostics(packed, logp.detach().cpu()))
        if measure_mismatch:
            a, b, n = mismatch_sums(packed, logp.detach().cpu())
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

    def save(
        self, run_dir: str | Path, step: int | None = None, extra: dict | None = None, tokenizer: Any = None
    ) -> Path:
        """A checkpoint of this step (by default the version) with `extra` (by default the store's watermark:
        the batches trained so far, which a resume rewinds the store to)."""
        if extra is None:
            extra = {"watermark": self.store.watermark() if self.store is not None else self.version}
        return save_checkpoint(
            run_dir, self.version if step is None else step, self.model, self.optimizer,
            version=self.version, extra=extra, tokenizer=tokenizer or self.tokenizer,
        )  # fmt: skip

    def restore(self, run_dir: str | Path) -> Checkpoint | None:
        """Loads the newest valid checkpoint into model, optimizer and RNGs; None if there is none."""
        ckpt = load_latest(run_dir)
        if ckpt is not None:
            ckpt.restore(self.model, self.optimizer)
            self.version = ckpt.version
        return ckpt
