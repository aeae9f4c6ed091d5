"""The learner role: one fixed rollout batch per step, sequential mini-batches, one optimizer step each
(no Ray; on Ray an actor holds one: runtime/learner_roles.py).

Data flow (docs/design.md §1)::

    train_step  take batch ── B credited trees (store.take_batch, recorded as batch k = store.watermark())
        │  step(trees)
        ▼
    select      zero_var_trees=drop (and TreePO's filter_zero_std) drop trees whose leaf rewards are all equal
    advantages  GRPO/GSPO: standardized leaf reward, group = tree;  TreePO: per-leaf Â, whitened over the
                whole batch's path tokens;  TreeOPSD: q from tree.credit (backup actor)
    mini-batch  trees shuffled (seeded by run seed and version) and split into n_mb groups of *whole trees*:
                a tree's turns share prefixes, so the packed forward needs the whole tree in one mini-batch
    μ, π_prox   stored sampler log-probs (or recomputed at θ_old); π_prox scored at the step start (§11.1)
    loop        for epoch, mini-batch: forward (tree-packed or path-by-path) → loss → backward → clip → AdamW
        ▼
    publish     version += 1; named_weights() → the weight source; the store learns the new version
    checkpoint  every `learner.checkpoint_every` steps: weights, optimizer, RNG, version and the watermark
    log         the returned dict of `learner/...` floats → the metrics sink (the caller)

The step count is the version (a resumed run restores it with the checkpoint). In-process::

    learner = Learner(model, cfg, store=store, weights=channel)
    learner.start(resume=False)             # publishes version 0 (or restores the newest checkpoint)
    stats = learner.train_step()            # None until B credited trees wait in the store
    stats = learner.step(trees)             # the training part alone, on any trees
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from configs.schema import Config
from learner.device import adamw, attention_for, compute_scope, learner_device, learner_sampling, warmup_lr
from learner.diagnostics import (
    combine_microbatches,
    microbatch_stats,
    nonfinite_turns,
    padding_stats,
    summarize_minibatches,
)
from learner.flex_attention import compiled_graphs
from learner.forward import attention_scope, token_logprobs
from learner.lora import published_weights
from learner.methods import METHODS
from learner.minibatch import MinibatchTargets, loss_reference, weighted_tokens
from learner.packing import PackedBatch
from learner.parallel_plan import Padding, ParallelPlan, Pass, SingleProcess
from learner.reference_pass import ProximalSums, reference_pass
from learner.step_plan import micro_inputs, minibatch_groups, select_trees, selection_stats, step_targets
from learner.turn_record import TurnRecorder
from storage.checkpoint import Checkpoint, checkpoint_bytes, checkpointed_metrics
from system.interfaces import StoreClient, WeightSource
from system.microbatch import Piece
from system.staleness import batch_metrics, drift_lag, drift_warning, version_lags
from system.tree import RolloutTree, check_nonfinite_fraction


class Learner:
    """Holds the model, AdamW and the policy version; `step` trains on one fixed rollout batch.

    attention (None: from `learner.tree_attention`): "tree", tree-packed trees (or varlen path sequences) in
    one unpadded row through the chunked block-sparse SDPA plan; "flex", the same rows through FlexAttention
    (CUDA); "mask", one padded row per tree with the dense 4D float mask through the model's own eager/sdpa
    (the reference). `learner.packed_forward` picks trees vs root-to-leaf sequences; all give the same
    losses and gradients up to float rounding. The model moves to the learner's device (learner/device.py).

    parallel (None: `SingleProcess`): how the learner spreads over processes (learner/parallel_plan.py); the
    FSDP2 ranks' plan is learner/sharded.py's `Fsdp2Ranks`. The loop below is the same for every plan.
    """

    # algo.proximal = step_start: the first mini-batch's π_prox from its own forward, not the no-grad pass
    # (False: every mini-batch scored by that pass, the reference the equivalence test compares against)
    reuse_first_forward = True

    def __init__(
        self,
        model: nn.Module,
        cfg: Config,
        optimizer: torch.optim.Optimizer | None = None,
        attention: Literal["tree", "flex", "mask"] | None = None,
        *,
        store: StoreClient | None = None,
        weights: WeightSource | None = None,
        tokenizer: Any = None,
        parallel: ParallelPlan | None = None,
    ):
        self.device, self.cfg = learner_device(cfg), cfg
        self.parallel: ParallelPlan = parallel or SingleProcess()
        self.model = self.parallel.place(model, cfg, self.device)  # learner/parallel_plan.py (FSDP2: sharded)
        self.attention = attention or attention_for(cfg, self.device)
        self.store, self.weights, self.tokenizer = store, weights, tokenizer
        self.method = METHODS[cfg.algo.method]  # its advantages, normalizer and loss (learner/methods.py)
        self.optimizer = optimizer or adamw(self.model, cfg, self.device)
        self._base_lrs = [g["lr"] for g in self.optimizer.param_groups]  # what a warmup scales
        self.sampling = learner_sampling(cfg)  # π is scored under the distribution μ sampled from
        self.version = 0
        self.wait_s = 0.0
        self.lag_history: list[int] = []  # per-tree version lags since the last pop, for the histogram
        # the newest trained step's metrics, kept from the moment the step is applied: a call that fails
        # after that (publish, checkpoint, a lost store) loses its return value, not the record of the step
        self.last_metrics: dict[str, float] | None = None
        self.drift_warned: set[float] = set()  # the turn-KL levels already warned of (system/staleness.py)
        self.turns: TurnRecorder | None = None  # set by train_step: the step's turns for `treeopsd view`

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
        t0 = time.perf_counter()
        batch_index, trees = self.parallel.take_batch(self.store, self.cfg.learner.batch_trees)
        if trees is None:
            time.sleep(idle_sleep_s)  # back off instead of spinning a remote store
            self.wait_s += time.perf_counter() - t0
            return None
        self.lag_history.extend(version_lags(trees, self.version).tolist())
        if self.cfg.logging.learner_turns:
            rank = self.parallel.progress().get("rank", 0)
            self.turns = TurnRecorder(self.cfg.run.run_dir, batch_index, self.version, rank)
        try:
            metrics = {**batch_metrics(trees, self.version), **self.step(trees)}
            if self.turns is not None:
                self.turns.write()
        finally:
            self.turns = None
        metrics.update({"learner/batch_index": float(batch_index), "learner/step": float(self.version)})
        self._watch_drift(metrics)
        self.last_metrics = metrics
        metrics["weights/publish_s"] = self._publish()
        if self.version % self.cfg.learner.checkpoint_every == 0:
            t_ckpt = time.perf_counter()
            path = self.save(self.cfg.run.run_dir)
            metrics["learner/checkpoint_s"] = time.perf_counter() - t_ckpt
            metrics["learner/checkpoint_mb"] = checkpoint_bytes(path) / 1e6
        busy = time.perf_counter() - t0
        metrics["learner/wait_for_batch_s"] = self.wait_s
        metrics["learner/idle_ratio"] = self.wait_s / max(self.wait_s + busy, 1e-9)
        self.wait_s = 0.0
        return metrics

    def _watch_drift(self, metrics: dict[str, float]) -> None:
        """The step's turn KL (docs/algorithm.md §11.1): a warning line the first time it passes 0.3 and 1,
        and with `store.max_turn_kl` the lag the store may admit from now on (`store/lag_limit`)."""
        turn_kl = metrics.get("correction/turn_kl")
        if turn_kl is None or not self.parallel.is_leader:
            return
        if (line := drift_warning(turn_kl, self.drift_warned)) is not None:
            print(line, file=sys.stderr, flush=True)
        bound = self.cfg.store.max_turn_kl
        if bound is not None and self.store is not None:
            lag = drift_lag(self.cfg.admission_eta, turn_kl, metrics.get("weights/version_lag", 0.0), bound)
            self.store.limit_lag(lag)
            metrics["store/lag_limit"] = float(lag)

    def last_step_metrics(self) -> dict[str, float] | None:
        """The newest trained step's metrics (None before the first): what the driver logs for a step whose
        call failed after the step was applied (runtime/supervision.py). A restored learner has those of its
        checkpoint's step: a learner killed after saving step k, before its call returned, is restarted
        from step k, and step k is logged from there (else its batch would be trained but never logged)."""
        return self.last_metrics

    def _publish(self) -> float:
        """The weights to the weight source, the version to the store: by the leading process alone, after
        every process joined the weights' gather where the plan's is a collective."""
        t0, leader = time.perf_counter(), self.parallel.is_leader
        if self.weights is not None or self.parallel.weights_are_collective:
            weights = published_weights(self.model, self.cfg, self.named_weights)  # LoRA: the adapter
            if leader and self.weights is not None:
                self.weights.publish(weights, self.version)
        if leader and self.store is not None:
            self.store.set_learner_version(self.version)
        return time.perf_counter() - t0

    def pop_lags(self) -> list[int]:
        lags, self.lag_history = self.lag_history, []
        return lags

    def progress(self) -> dict[str, int]:
        return {"step": self.version, "version": self.version, **self.parallel.progress()}  # ranks: + "rank"

    def endpoint(self) -> tuple[str, bytes | None]:
        """Where the samplers subscribe: the weight publisher's address and public key."""
        return self.weights.endpoint, self.weights.public_key  # type: ignore[union-attr]

    def save_final(self) -> str:
        return str(self.save(self.cfg.run.run_dir))

    def stop(self) -> None:
        if callable(close := getattr(self.weights, "close", None)):
            close()
        self.parallel.stop()  # ranks: the process group goes

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """One update on a rollout batch, readable top to bottom: per epoch and mini-batch, each micro-batch's
        forward, its share of the method's loss, backward; then one clipped AdamW step."""
        t0, algo = time.perf_counter(), self.cfg.algo
        warmup_lr(self.optimizer, self._base_lrs, self.version, self.cfg.learner.warmup_steps)
        batches, targets, stats, prox = self._prepare(trees)
        per_mb: list[dict[str, float]] = []
        for epoch in range(self.cfg.learner.epochs):
            for j, micro in enumerate(batches):
                first = epoch == j == 0 and algo.behavior_logprobs == "sampler" and not self.proximal
                self.optimizer.zero_grad(set_to_none=True)
                parts = []
                for packed in self._passes(micro):
                    with attention_scope(self.model, packed, self.attention):  # held through backward
                        logp = self.logprobs(packed)
                        if prox is not None and packed.proximal_logp is None:  # the first mini-batch
                            packed = prox.add(packed.with_proximal_logp(logp))
                        ref, weights = loss_reference(algo, packed)  # μ or π_prox; the correction
                        loss, st = self.method.loss(algo, packed, logp.float(), ref, weights, targets[j])
                        loss.backward()
                    st.update(loss=float(loss.detach()), **weighted_tokens(packed, weights))
                    turn_view = (ref, None if self.method.trains_paths else weights)  # weights per turn token
                    version = self.version if first else None
                    parts.append(microbatch_stats(packed, logp.detach(), st, version, turn_view))
                    if self.turns is not None and epoch == 0:
                        self.turns.add(packed, logp, *turn_view, targets[j].tree_ids, targets[j].z, j)
                per_mb.append(self._optimizer_step(parts))
        self.version += 1
        stats.update(summarize_minibatches(per_mb) | (prox.metrics(self.parallel.all_ranks) if prox else {}))
        real = float(sum(isinstance(p, PackedBatch) for micro in batches for p in micro))
        (stats["learner/microbatches"],) = self.parallel.sum_over_ranks([real])  # every rank's, no padding
        stats.update({"learner/step_s": time.perf_counter() - t0, "learner/version": float(self.version)})
        stats["learner/lr"] = float(self.optimizer.param_groups[0]["lr"])
        stats["learner/compiles"] = float(compiled_graphs())
        return stats

    def _prepare(
        self, trees: Sequence[RolloutTree]
    ) -> tuple[list[list[Pass]], list[MinibatchTargets], dict[str, float], ProximalSums | None]:
        """The step's micro-batches (μ recomputed or π_prox attached by one no-grad scoring pass where asked;
        with one epoch the first mini-batch's π_prox is its own forward, `step` attaches it), their targets,
        the batch's selection and padding stats, and the proximal sums to add that mini-batch to."""
        kept = select_trees(self.cfg.algo, self.method, trees, self.version)
        stats = selection_stats(trees, kept)
        batches, targets = self.plan(trees)
        prox = None
        if self.cfg.algo.behavior_logprobs == "recompute" or self.proximal:  # one no-grad scoring pass
            own = int(self.proximal and self.reuse_first_forward and self.cfg.learner.epochs == 1)
            scores = [[None] * len(m) for m in batches[:own]] + self._scored(batches[own:])
            ranks = self.parallel.all_ranks
            batches, prox = reference_pass(self.cfg.algo, batches, scores, self.version, ranks, stats)
        real = [p for micro in batches for p in micro if isinstance(p, PackedBatch)]  # no padding passes
        bad, total = np.sum(self.parallel.all_ranks(nonfinite_turns(real)), axis=0)  # over every rank
        check_nonfinite_fraction(int(bad), int(total), self.cfg.algo.nonfinite_turn_limit)  # §10: refused
        stats.update(padding_stats([p for micro in batches for p in micro]))
        return batches, targets, stats, prox

    def _pack(self, trees: list[RolloutTree]) -> list[Pass]:
        """This process's passes of one mini-batch, on the learner's device: its token-budget micro-batches,
        then the plan's padding passes (one rank: none)."""
        lc = self.cfg.learner
        share = self.parallel.share(trees, lc.max_tokens_per_microbatch, lc.packed_forward)
        passes: list[Pass] = [self._inputs(trees, m) for m in share.micro]
        if share.padding_piece is not None:
            passes += [Padding(self._inputs(trees, [share.padding_piece]))] * share.padding
        return passes

    def _inputs(self, trees: list[RolloutTree], micro: Sequence[Piece]) -> PackedBatch:
        lc, full = self.cfg.learner, self.method.trains_paths
        return micro_inputs(trees, micro, lc, full, self.attention).to(self.device)

    @property
    def proximal(self) -> bool:
        return self.cfg.algo.proximal == "step_start"

    def _scored(self, batches: list[list[Pass]]) -> list[list[torch.Tensor | None]]:
        """Every micro-batch's log-probs at the weights held now (no grad); a padding pass forwards too (every
        rank joins each all-gather) and scores None."""
        with torch.no_grad():
            return [[self._score_pass(p) for p in micro] for micro in batches]

    def _score_pass(self, p: Pass) -> torch.Tensor | None:
        if isinstance(p, Padding):
            self.logprobs(p.packed)
            return None
        return self.logprobs(p)

    # ---- one mini-batch -------------------------------------------------------------------------------
    def _passes(self, micro: list[Pass]) -> Iterator[PackedBatch]:
        """The micro-batches this process runs forward and backward; a padding pass joins the collectives
        here, in its place, and is not yielded (one process has none: learner/parallel_plan.py)."""
        for p in micro:
            if isinstance(p, Padding):
                self._join(p.packed)
            else:
                yield p

    def _join(self, packed: PackedBatch) -> None:
        """A padding pass: the forward's all-gathers and the backward's reduce-scatters, zero gradient."""
        with attention_scope(self.model, packed, self.attention):
            logp = self.logprobs(packed)
            (torch.nan_to_num(logp).sum() * 0.0).backward()

    def _optimizer_step(self, parts: list[dict[str, Any]]) -> dict[str, float]:
        """The clipped AdamW step after the mini-batch's backward passes (none when the correction left it
        no token: AdamW's momentum and decay would still move the weights); the stats of every rank's
        micro-batches combined, so every rank skips alike (on ranks the norm is over every rank's shards)."""
        combined = combine_microbatches([p for rank in self.parallel.all_ranks(parts) for p in rank])
        if not combined.get("weighted_tokens", 1.0):
            return {**combined, "grad_norm": 0.0, "skipped": 1.0}
        norm = self.parallel.clip_grad_norm(self.model.parameters(), self.cfg.learner.grad_clip)
        self.optimizer.step()
        return {**combined, "grad_norm": norm}

    def logprobs(self, packed: PackedBatch) -> torch.Tensor:
        """π's log-probs of the loss tokens (`forward.token_logprobs`), under the precision's scope."""
        with compute_scope(self.device, self.cfg.learner.precision):  # FSDP2: through the root module
            return self.parallel.forward(self.model, lambda m: self.score(m, packed))

    def score(self, model: nn.Module, packed: PackedBatch) -> torch.Tensor:
        """`forward.token_logprobs` with this learner's kernel, sampling distribution and LM-head chunk."""
        lc = self.cfg.learner
        tf32 = lc.precision == "bfloat16"  # the LM head's fp32 matmuls on TF32 cores (learner/lm_head.py)
        return token_logprobs(model, packed, self.attention, self.sampling, lc.logprob_chunk_tokens, tf32)

    def plan(self, trees: Sequence[RolloutTree]) -> tuple[list[list[Pass]], list[MinibatchTargets]]:
        """The mini-batches of `trees` as packed micro-batches and their targets, as `step` trains them."""
        algo, lc = self.cfg.algo, self.cfg.learner
        kept = select_trees(algo, self.method, trees, self.version)
        groups = minibatch_groups(self.cfg.run.seed, self.version, len(kept), lc.minibatches)
        targets = step_targets(algo, self.method, kept, groups)
        return [self._pack([kept[i] for i in g]) for g in groups], targets

    # ---- weights and checkpoints ------------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The full parameters in `weights.dtype` as the samplers get them (tied weights once; with LoRA
        merged, learner/lora.py), as CPU copies a publisher may serialize while the next step updates the
        model; on ranks gathered on rank 0 ({} elsewhere), a collective."""
        return self.parallel.named_weights(self.model, getattr(torch, self.cfg.weights_dtype))

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
            if self.last_metrics is not None:  # a learner killed before the step's call returned keeps them
                extra["step_metrics"] = {k: float(v) for k, v in self.last_metrics.items()}
        return self.parallel.write_checkpoint(  # one process's safetensors, or every rank's DCP shards
            run_dir,
            self.version if step is None else step,
            self.model,
            self.optimizer,
            version=self.version,
            extra=extra,
            tokenizer=tokenizer or self.tokenizer,
        )

    def restore(self, run_dir: str | Path) -> Checkpoint | None:
        """Loads the newest valid checkpoint into model, optimizer and RNGs (either format, on any number of
        ranks: learner/parallel_plan.py); None if there is none."""
        ckpt = self.parallel.restore(run_dir, self.model, self.optimizer)
        if ckpt is not None:
            self.version = ckpt.version
            self.last_metrics = checkpointed_metrics(ckpt)
        return ckpt
