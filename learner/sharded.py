"""The sharded learner: `Learner` over R ranks with FSDP2, exact global normalization (docs/design.md §12).
`Fsdp2Ranks` is its parallel plan (learner/parallel_plan.py): the learner's loop is the one-process loop, and
this plan decides what differs on a rank.

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
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.optim import Optimizer

from configs.schema import Config
from learner.device import prepare_model
from learner.distributed import (
    Scorer,
    all_reduce_sums,
    broadcast_bytes,
    broadcast_ints,
    clip_global_norm,
    device_mesh,
    gather_json,
    init_process_group,
    shard_model,
)
from learner.learner import Learner
from learner.lora import check_restorable
from learner.lora_sharded import keep_base_fingerprint, save_dcp_with_adapter, served_from_full
from learner.minibatch import microbatch_pieces
from learner.parallel_plan import Padding, RankShare
from storage.checkpoint import Checkpoint, load_latest, verify_checkpoint
from storage.dcp_checkpoint import restore_into
from storage.tree_codec import decode_ipc, encode_ipc
from system.interfaces import StoreClient
from system.microbatch import Piece, first_fit_decreasing
from system.tree import RolloutTree

__all__ = ["Fsdp2Ranks", "Padding", "assign_to_ranks", "init_process_group", "rank_plan", "sharded_learner"]


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


def sharded_learner(model: nn.Module, cfg: Config, **kwargs: Any) -> Learner:
    """`Learner` on this rank of an initialized process group, with the `Fsdp2Ranks` plan (module docstring).
    Rank 0 alone holds the store client and the weight source; the
    others pass None."""
    return Learner(model, cfg, parallel=Fsdp2Ranks(dist.get_rank(), dist.get_world_size()), **kwargs)


class Fsdp2Ranks:
    """The parallel plan of one FSDP2 rank (learner/parallel_plan.py `ParallelPlan`)."""

    weights_are_collective = True  # the full state dict (LoRA: the adapter) is gathered from every rank

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.is_leader = rank == 0
        self.scorer: Scorer | None = None  # the FSDP2 root, once `place` has sharded the model

    def place(self, model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
        model = prepare_model(model, cfg, device)  # fp32 master weights, dropout off, checkpointing
        keep_base_fingerprint(model)  # LoRA: while the base is whole
        self.scorer = shard_model(model, device_mesh(device), cfg.learner.precision)
        return model

    def forward(self, model: nn.Module, compute: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
        """Through the FSDP2 root: each call gathers the root group before and reduces its gradients after."""
        assert self.scorer is not None, "place the model first"
        return self.scorer(compute)

    def take_batch(self, store: StoreClient | None, n: int) -> tuple[int, list[RolloutTree] | None]:
        """Rank 0 takes the batch from the store; every rank gets its Arrow IPC bytes (no pickle)."""
        buf, index = None, 0
        if self.rank == 0:
            assert store is not None, "rank 0 needs the store"
            index = store.watermark()
            buf = _take_batch_ipc(store, n)
        (index,) = broadcast_ints([index])
        buf = broadcast_bytes(buf)
        return index, None if buf is None else decode_ipc(buf, "learner batch")

    def share(self, trees: Sequence[RolloutTree], budget: int, packed_forward: bool) -> RankShare:
        """This rank's micro-batches of one mini-batch, and padding passes up to the most any rank has: the
        smallest piece of the mini-batch carries them."""
        pieces = microbatch_pieces(trees, budget, packed_forward)
        plan = rank_plan(pieces, budget, self.world)
        mine = plan[self.rank]
        padding = max(len(p) for p in plan) - len(mine)
        if not padding:
            return RankShare(mine)
        smallest = min(pieces, key=lambda p: (p.tokens, p.tree, p.nodes[0]))
        return RankShare(mine, padding, smallest)

    def all_ranks(self, value: Any) -> list[Any]:
        return gather_json(value)

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        return all_reduce_sums(values)

    def clip_grad_norm(self, params: Iterable[torch.Tensor], max_norm: float) -> float:
        """The norm over every rank's gradient shards, the same scale on every rank."""
        return clip_global_norm(params, max_norm)

    def named_weights(self, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The full parameters on rank 0 ({} elsewhere): every rank joins the gather. With LoRA the served
        ones, as one rank's: merged, under the base's names."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full: dict[str, Any] = get_model_state_dict(model, options=options)
        if self.rank != 0:
            return {}
        served = served_from_full(model, full)
        names = [n for n, _ in model.named_parameters() if n in served]  # tied ones once, as on 1 rank
        return {n: served[n].to(dtype).contiguous() for n in names}

    def write_checkpoint(
        self, run_dir: str | Path, step: int, model: nn.Module, optimizer: Optimizer, **kwargs: Any
    ) -> Path:
        """DCP: every rank its shards, rank 0 the rest (learner/lora_sharded.py)."""
        return save_dcp_with_adapter(run_dir, step, model, optimizer, **kwargs)

    def restore(self, run_dir: str | Path, model: nn.Module, optimizer: Optimizer) -> Checkpoint | None:
        """Rank 0 picks the newest valid checkpoint, every rank loads it (either format; DCP reshards to
        this rank count)."""
        chosen = load_latest(run_dir) if self.rank == 0 else None
        path = broadcast_bytes(None if chosen is None else str(chosen.path).encode())
        if path is None:
            return None
        ckpt = chosen or verify_checkpoint(Path(path.decode()), hashes=False)
        check_restorable(ckpt, model)  # LoRA: one line refuses another base or kind, before any load
        restore_into(ckpt, model, optimizer)
        return ckpt

    def progress(self) -> dict[str, int]:
        return {"rank": self.rank}

    def stop(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _take_batch_ipc(store: Any, n: int) -> bytes | None:
    """The batch as the store's IPC bytes (RemoteStore and ReplayStore have them), else encoded here."""
    take = getattr(store, "take_batch_ipc", None)
    if take is not None:
        return take(n)
    trees = store.take_batch(n)
    return None if trees is None else encode_ipc(trees)
