"""How the learner spreads over processes, as one object plugged into `Learner` (learner/learner.py)
instead of a subclass that overrides its steps. The learner's loop — select, plan, score, forward, loss,
backward, clip, step, publish, checkpoint — is one and the same; what differs between one process and R
FSDP2 ranks is a short list of decisions, and a `ParallelPlan` supplies each of them:

    place           the model on the device (and, on ranks, `fully_shard` over it)
    forward         a log-prob computation through the model (on ranks, through the FSDP2 root)
    take_batch      the batch from the store (on ranks, rank 0 takes it and broadcasts it)
    share           this process's micro-batches of one mini-batch, and how many padding passes it adds
    all_ranks       a JSON-able value from every process (collectives of one here)
    sum_over_ranks  floats summed over processes
    clip_grad_norm  the clipped gradient norm (on ranks, over every rank's shards)
    named_weights   the full parameters to publish (on ranks, gathered on rank 0)
    write_checkpoint / restore   one process's safetensors file, or every rank's DCP shards
    progress / stop the role's extra keys, and what to tear down at the end

`SingleProcess` is the plan of one process; `Fsdp2Ranks` (learner/sharded.py) the one of R ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from configs.schema import Config
from learner.device import prepare_model
from learner.lora import restore_with_adapter, save_with_adapter, served_parameters
from learner.minibatch import plan_microbatches
from learner.packing import PackedBatch
from storage.checkpoint import Checkpoint, load_latest
from system.interfaces import StoreClient
from system.microbatch import Piece
from system.tree import RolloutTree


@dataclass(frozen=True)
class Padding:
    """A pass that only joins the collectives: forward and backward of `packed` with its loss × 0 (a rank
    with fewer micro-batches than another runs these so that every all-gather has every rank)."""

    packed: PackedBatch


Pass = PackedBatch | Padding  # one forward/backward of a mini-batch on this process


@dataclass(frozen=True)
class RankShare:
    """This process's part of one mini-batch: the pieces of each of its micro-batches, then `padding`
    passes over `padding_piece` (a piece of the mini-batch, so the pass has real shapes)."""

    micro: list[list[Piece]]
    padding: int = 0
    padding_piece: Piece | None = field(default=None)


class ParallelPlan(Protocol):
    """What `Learner` asks of the processes it runs on (module docstring)."""

    is_leader: bool  # this process alone publishes and tells the store the version
    weights_are_collective: bool  # every process joins `named_weights`, also one that publishes nothing

    def place(self, model: nn.Module, cfg: Config, device: torch.device) -> nn.Module: ...

    def forward(self, model: nn.Module, compute: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor: ...

    def take_batch(self, store: StoreClient | None, n: int) -> tuple[int, list[RolloutTree] | None]: ...

    def share(self, trees: Sequence[RolloutTree], budget: int, packed_forward: bool) -> RankShare: ...

    def all_ranks(self, value: Any) -> list[Any]: ...

    def sum_over_ranks(self, values: list[float]) -> list[float]: ...

    def clip_grad_norm(self, params: Iterable[torch.Tensor], max_norm: float) -> float: ...

    def named_weights(self, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]: ...

    def write_checkpoint(
        self, run_dir: str | Path, step: int, model: nn.Module, optimizer: Optimizer, **kwargs: Any
    ) -> Path: ...

    def restore(self, run_dir: str | Path, model: nn.Module, optimizer: Optimizer) -> Checkpoint | None: ...

    def progress(self) -> dict[str, int]: ...

    def stop(self) -> None: ...


class SingleProcess:
    """The learner in one process: every collective is over one, every micro-batch is this process's."""

    is_leader = True
    weights_are_collective = False  # nothing to gather: no publisher, no weights copied

    def place(self, model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
        """The model on the learner's device in fp32 (dropout off: the first mini-batch then runs exactly at
        θ_old, s ≡ 0 with recomputed μ)."""
        return prepare_model(model, cfg, device)

    def forward(self, model: nn.Module, compute: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
        return compute(model)

    def take_batch(self, store: StoreClient | None, n: int) -> tuple[int, list[RolloutTree] | None]:
        """(k, batch k): k = the store's watermark, the id take_batch records this batch under."""
        assert store is not None, "train_step needs a store (Learner(..., store=...))"
        return store.watermark(), store.take_batch(n)

    def share(self, trees: Sequence[RolloutTree], budget: int, packed_forward: bool) -> RankShare:
        return RankShare(plan_microbatches(trees, budget, packed_forward))

    def all_ranks(self, value: Any) -> list[Any]:
        return [value]

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        return values

    def clip_grad_norm(self, params: Iterable[torch.Tensor], max_norm: float) -> float:
        """torch's `clip_grad_norm_` (max_norm ≤ 0: the norm only)."""
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))

    def named_weights(self, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Detached CPU copies (tied weights once, as save_pretrained writes them; with LoRA merged,
        learner/lora.py); copies, so a publisher may serialize them while the next step updates the model."""
        return {n: p.detach().to("cpu", dtype, copy=True) for n, p in served_parameters(model).items()}

    def write_checkpoint(
        self, run_dir: str | Path, step: int, model: nn.Module, optimizer: Optimizer, **kwargs: Any
    ) -> Path:
        """safetensors + optimizer (storage/checkpoint.py; LoRA: + the adapter)."""
        return save_with_adapter(run_dir, step, model, optimizer, **kwargs)

    def restore(self, run_dir: str | Path, model: nn.Module, optimizer: Optimizer) -> Checkpoint | None:
        """The newest valid checkpoint loaded into model and optimizer: one process's, a sharded run's (DCP)
        or a LoRA run's adapter (learner/lora.py); None if there is none."""
        ckpt = load_latest(run_dir)
        if ckpt is not None:
            restore_with_adapter(ckpt, model, optimizer)
        return ckpt

    def progress(self) -> dict[str, int]:
        return {}

    def stop(self) -> None:
        return None
