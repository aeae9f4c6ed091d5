"""LoRA on the sharded learner (learner.ranks > 1, learner/sharded.py): what differs from one rank.

    keep_base_fingerprint(model)         # before fully_shard: the frozen base's fingerprint, kept
    save_dcp_with_adapter(run_dir, ...)  # Fsdp2Ranks.write_checkpoint: merged weights + adapter
    served_from_full(model, full)        # rank 0's gathered state dict → the served (merged) weights

**Sharding.** FSDP2's `fully_shard` (learner/distributed.py `shard_model`) takes each decoder layer with its
frozen base weights and its trainable `lora_A`/`lora_B` in one parameter group (FSDP2 allows mixed
`requires_grad` in a group): every forward all-gathers both, every backward reduce-scatters the adapters'
gradients only (the base has none). So AdamW holds the adapters' shards alone (learner/device.py `adamw`), and
the clipping norm (learner/distributed.py `clip_global_norm`, over parameters with a gradient) is the
adapters' norm over every rank, as on one rank.

**Publishing.** `published_weights` (learner/lora.py) runs on every rank: the adapter message gathers each
adapter tensor from its shards (`whole`), the same tensors and header meta as one rank's
(system/lora_sync.py `adapter_message`), and only rank 0 publishes it. The base's fingerprint is read from
the model (`KEPT_FINGERPRINT`), computed here before sharding: gathering the whole base for it at every
version would cost what the adapter-only message saves. Merged weights (samplers that take no adapter) are
folded into rank 0's gathered state dict (`served_from_full`).

**Checkpoints.** storage/dcp_checkpoint.py with an `Adapter` as a one-rank LoRA checkpoint has: the merged
weights (W + scale·B·A, DTensor arithmetic on each rank's shards) under the base's names, so export and
`full_model_tensors` read it as any checkpoint, the adapter beside them and `adapter_meta` (base
fingerprint, rank, alpha) in meta.json. A resume (Fsdp2Ranks.restore) refuses in one line another base,
rank or kind (learner/lora.py `check_restorable`) and then loads the adapter and AdamW's moments alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from learner.lora import (
    KEPT_FINGERPRINT,
    adapter_meta,
    adapter_state,
    base_fingerprint,
    lora_layers,
    merged_state,
)
from storage.checkpoint import Adapter
from storage.dcp_checkpoint import save_dcp_checkpoint
from system.lora_sync import ADAPTER_NAMES


def keep_base_fingerprint(model: nn.Module) -> None:
    """Records an adapted model's base fingerprint on it while its tensors are whole (before fully_shard);
    `base_fingerprint` reads it from then on. A model without LoRA: nothing."""
    if lora_layers(model):
        setattr(model, KEPT_FINGERPRINT, base_fingerprint(model))


def save_dcp_with_adapter(
    run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any
) -> Path:
    """storage/dcp_checkpoint.py `save_dcp_checkpoint` on every rank; an adapted model's with its adapter
    (module docstring)."""
    adapter = None
    if lora_layers(model):
        adapter = Adapter(adapter_state(model), merged_state(model), adapter_meta(model))
    return save_dcp_checkpoint(run_dir, step, model, optimizer, adapter=adapter, **kwargs)


@torch.no_grad()
def served_from_full(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict of `model` (gathered on rank 0) with each adapter folded into its weight as
    `LoRALinear.merged_weight` folds it (W + (B·A)·scale) and the adapter tensors left out; a model without
    LoRA: `full` as it is."""
    layers = lora_layers(model)
    if not layers:
        return full
    out = {k: v for k, v in full.items() if k.rsplit(".", 1)[-1] not in ADAPTER_NAMES}
    for name, layer in layers.items():
        a, b = full[f"{name}.lora_A"], full[f"{name}.lora_B"]
        out[f"{name}.weight"] = full[f"{name}.weight"] + (b @ a) * layer.scaling
    return out
