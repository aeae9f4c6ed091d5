"""The sharded learner: `Learner` over R ranks with FSDP2, exact global normalization (docs/design.md §12).

Every rank receives the same rollout batch (rank 0 takes it from the store and broadcasts its Arrow IPC
bytes), computes the same plan — the same seeded mini-batch split and the same targets, Z included, from the
whole mini-batch (learner/minibatch.py) — and trains only its share of each mini-batch:

    pieces  the mini-batch's pieces (whole trees, or subtrees with context under the token budget)
    ranks   pieces → ranks, largest first onto the least-loaded rank (`assign_to_ranks`: by tokens,
            deterministic), then each rank's pieces → micro-batches first-fit-decreasing under the budget
    passes  every rank runs max_r(micro-batches of rank r) forward/backward passes: FSDP2 all-gathers in every
            forward and reduce-scatters in every backward, so a rank with fewer (or no) micro-batches joins
            with `Padding` passes (loss × 0) and nothing waits forever
    reduce  each share is over the global Z, so gradients are *summed* over ranks (learner/distributed.py);
            the norm for clipping is the global one; the micro-batch stats of all ranks are gathered and
            combined exactly as one rank combines its own

The sum over ranks of the shares is the one-shot loss, so R ranks train the same step as one rank up to float
rounding (tests/ray/test_learner_group.py: ≤ 1e-5 in fp32). Weights for the broadcast are one full state dict
gathered on rank 0, which alone publishes; checkpoints are torch DCP shards (storage/dcp_checkpoint.py). LoRA
(learner.lora.rank > 0) shards the frozen base and the adapters alike, publishes the adapter gathered from its
shards and checkpoints merged weights + adapter (learner/lora_sharded.py).
The process group must be up before construction (runtime/learner_roles.py, or any script that runs
`distributed.init_process_group`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from learner.device import compute_scope, prepare_model
from learner.diagnostics import combine_microbatches
from learner.distributed import (
    all_reduce_sums,
    broadcast_bytes,
    broadcast_ints,
    clip_global_norm,
    device_mesh,
    gather_json,
    init_process_group,
    shard_model,
)
from learner.forward import attention_scope
from learner.learner import Learner
from learner.lora import check_restorable, published_weights
from learner.lora_sharded import keep_base_fingerprint, save_dcp_with_adapter, served_from_full
from learner.minibatch import microbatch_pieces
from learner.packing import PackedBatch
from storage.checkpoint import Checkpoint, checkpointed_metrics, load_latest, verify_checkpoint
from storage.dcp_checkpoint import restore_into
from storage.tree_codec import decode_ipc, encode_ipc
from system.microbatch import Piece, first_fit_decreasing
from system.tree import RolloutTree

__all__ = ["Padding", "ShardedLearner", "assign_to_ranks", "init_process_group", "rank_plan"]


def assign_to_ranks(tokens: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of `tokens` per rank, balanced by tokens: largest first (ties: lower index) onto the rank
    with the least so far (ties: lower rank). Deterministic, so every rank computes the same assignment."""
    heap = [(0, r) for r in range(ranks)]
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + int(tokens[i]), r))
    return [sorted(x) for x in out]


def rank_plan(pieces: Sequence[Piece], budget: int, ranks: int) -> list[list[list[Piece]]]:
    """Per rank, its micro-batches: pieces spread over ranks by tokens, then first-fit-decreasing under
    `budget` within each rank (≤ 0: one micro-batch per rank that has pieces)."""
    split = assign_to_ranks([p.tokens for p in pieces], ranks)
    return [first_fit_decreasing([pieces[i] for i in idx], budget) for idx in split]


@dataclass(frozen=True)
class Padding:
    """A pass that only joins the collectives: forward and backward of `packed` with its loss × 0."""

    packed: PackedBatch


class ShardedLearner(Learner):
    """`Learner` on one rank of an initialized process group (module docstring). Rank 0 alone holds the
    store client and the weight source; the others pass None."""

    write_checkpoint = staticmethod(save_dcp_with_adapter)  # every rank its shards, rank 0 the rest

    def __init__(self, model: nn.Module, cfg: Any, **kwargs: Any) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.microbatches = 0  # this step's real micro-batches on this rank
        super().__init__(model, cfg, **kwargs)

    def _place_model(self, model: nn.Module) -> nn.Module:
        model = prepare_model(model, self.cfg, self.device)  # fp32 master weights, dropout off, checkpointing
        keep_base_fingerprint(model)  # LoRA: while the base is whole
        self.scorer = shard_model(model, device_mesh(self.device), self.cfg.learner.precision)
        return model

    def logprobs(self, packed: PackedBatch) -> torch.Tensor:
        """Through the FSDP2 root, under the same bf16 scope as one rank (learner/device.py)."""
        with compute_scope(self.device, self.cfg.learner.precision):
            return self.scorer(lambda m: self.score(m, packed))

    # ---- the batch -------------------------------------------------------------------------------
    def _take_batch(self) -> tuple[int, list[RolloutTree] | None]:
        """Rank 0 takes the batch from the store; every rank gets its Arrow IPC bytes (no pickle)."""
        buf, index = None, 0
        if self.rank == 0:
            assert self.store is not None, "rank 0 needs the store"
            index = self.store.watermark()
            buf = _take_batch_ipc(self.store, self.cfg.learner.batch_trees)
        (index,) = broadcast_ints([index])
        buf = broadcast_bytes(buf)
        return index, None if buf is None else decode_ipc(buf, "learner batch")

    def step(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        self.microbatches = 0
        stats = super().step(trees)
        (stats["learner/microbatches"],) = all_reduce_sums([float(self.microbatches)])
        return stats

    def _pack(self, trees: list[RolloutTree]) -> list[PackedBatch]:
        """This rank's micro-batches of one mini-batch, padded to the most any rank has (`Padding`)."""
        lc = self.cfg.learner
        pieces = microbatch_pieces(trees, lc.max_tokens_per_microbatch, lc.packed_forward)
        plan = rank_plan(pieces, lc.max_tokens_per_microbatch, self.world)
        mine = [self._inputs(trees, m) for m in plan[self.rank]]
        self.microbatches += len(mine)
        passes = max(len(p) for p in plan)
        if len(mine) < passes:  # the smallest piece of the mini-batch carries the padding passes
            smallest = min(pieces, key=lambda p: (p.tokens, p.tree, p.nodes[0]))
            mine += [Padding(self._inputs(trees, [smallest]))] * (passes - len(mine))  # type: ignore[list-item]
        return mine

    def _scored(self, batches: list[list[PackedBatch]]) -> list[list[torch.Tensor | None]]:
        """As Learner's; a padding pass forwards too (every rank joins each all-gather) and scores None."""
        out: list[list[torch.Tensor | None]] = []
        with torch.no_grad():
            for micro in batches:
                out.append([])
                for packed in micro:
                    if isinstance(packed, Padding):
                        self.logprobs(packed.packed)
                    out[-1].append(None if isinstance(packed, Padding) else self.logprobs(packed))
        return out

    def _all_ranks(self, value: Any) -> list[Any]:
        return gather_json(value)

    # ---- one mini-batch ---------------------------------------------------------------------------
    def _passes(self, micro: list[PackedBatch]) -> Iterator[PackedBatch]:
        """This rank's real micro-batches; a padding pass joins the collectives here, in its place, and is
        not yielded (every rank runs as many passes as the rank with the most, `_pack`)."""
        for packed in micro:
            if isinstance(packed, Padding):
                self._join(packed.packed)
            else:
                yield packed

    def _optimizer_step(self, parts: list[dict[str, Any]]) -> dict[str, float]:
        """This rank's share of the gradient is in (summed over ranks by FSDP2): one clipped AdamW step on
        every rank's shards; the stats of every rank's micro-batches combined."""
        everyone = combine_microbatches([p for rank_parts in gather_json(parts) for p in rank_parts])
        if not everyone.get("weighted_tokens", 1.0):  # every rank's tokens masked: every rank skips alike
            return {**everyone, "grad_norm": 0.0, "skipped": 1.0}
        norm = clip_global_norm(self.model.parameters(), self.cfg.learner.grad_clip)
        self.optimizer.step()
        return {**everyone, "grad_norm": norm}

    def _join(self, packed: PackedBatch) -> None:
        """A padding pass: the forward's all-gathers and the backward's reduce-scatters, zero gradient."""
        with attention_scope(self.model, packed, self.attention):
            logp = self.logprobs(packed)
            (torch.nan_to_num(logp).sum() * 0.0).backward()

    # ---- weights and checkpoints ------------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The full parameters in `weights.dtype` on rank 0 ({} elsewhere): every rank joins the gather. With
        LoRA the served ones, as one rank's: merged, under the base's names."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full: dict[str, Any] = get_model_state_dict(self.model, options=options)
        if self.rank != 0:
            return {}
        dtype = getattr(torch, self.cfg.weights_dtype)
        served = served_from_full(self.model, full)
        names = [n for n, _ in self.model.named_parameters() if n in served]  # tied ones once, as on 1 rank
        return {n: served[n].to(dtype).contiguous() for n in names}

    def _publish(self) -> float:
        t0 = time.perf_counter()
        # a collective: every rank, also those that publish nothing (LoRA: the adapter, gathered from shards)
        weights = published_weights(self.model, self.cfg, self.named_weights)
        if self.rank == 0 and self.weights is not None:
            self.weights.publish(weights, self.version)
        if self.rank == 0 and self.store is not None:
            self.store.set_learner_version(self.version)
        return time.perf_counter() - t0

    def progress(self) -> dict[str, int]:
        return {**super().progress(), "rank": self.rank}

    def stop(self) -> None:
        super().stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def restore(self, run_dir: str | Path) -> Checkpoint | None:
        """Rank 0 picks the newest valid checkpoint, every rank loads it (either format; DCP reshards to
        this rank count)."""
        chosen = load_latest(run_dir) if self.rank == 0 else None
        path = broadcast_bytes(None if chosen is None else str(chosen.path).encode())
        if path is None:
            return None
        ckpt = chosen or verify_checkpoint(Path(path.decode()), hashes=False)
        check_restorable(ckpt, self.model)  # LoRA: one line refuses another base or kind, before any load
        restore_into(ckpt, self.model, self.optimizer)
        self.version = ckpt.version
        self.last_metrics = checkpointed_metrics(ckpt)
        return ckpt


def _take_batch_ipc(store: Any, n: int) -> bytes | None:
    """The batch as the store's IPC bytes (RemoteStore and ReplayStore have them), else encoded here."""
    take = getattr(store, "take_batch_ipc", None)
    if take is not None:
        return take(n)
    trees = store.take_batch(n)
    return None if trees is None else encode_ipc(trees)
