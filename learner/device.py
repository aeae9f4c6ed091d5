"""Where and how the learner computes: its device, bf16, gradient checkpointing (docs/design.md §11).

    device = learner_device(cfg)            # cuda when resources.learner.num_gpus > 0, else cpu
    prepare_model(model, cfg, device)       # moved there, fp32 master weights, dropout off, checkpointing,
                                            # LoRA adapters when learner.lora.rank > 0 (learner/lora.py)
    with compute_scope(device, cfg.learner.precision): forward      # bf16 matmuls or nothing

**One bf16 path, on one rank or many.** Mixed precision is autocast over fp32 parameters: every matmul casts
its weight and input to bf16 and runs in bf16; parameters, gradients (the cast's backward upcasts each
bf16 gradient before it is accumulated) and AdamW's state stay fp32 (what "fp32 master weights" means
without a second copy); the residual stream, norms, the LM head's log-softmax of the sampled tokens and
every loss run in fp32 (learner/forward.py computes the LM head outside autocast). The sharded learner runs
the same scope over FSDP2 (learner/distributed.py): its all-gathers carry bf16 copies of the fp32 shards
(`param_dtype`, half the bytes), which autocast then uses as they are, and it reduce-scatters gradients in
fp32; it does *not* cast the layers' inputs (`cast_forward_inputs=False`): FSDP2 skips that cast when
gradient checkpointing re-runs a layer in backward, which left fp32 activations against bf16 weights
(the CUDA failure "mat1 and mat2 must have the same dtype"), and the one-rank learner keeps its residual
stream in fp32 too. The autocast weight cache is off: with it, every layer's bf16 weight copy lives from the
first layer's forward to the end of the forward (8 GB for a 4B model); without it a copy lives for its
matmul (and, with checkpointing, for its layer's recompute), at the price of casting again in the
recompute, a memory-bound pass over the weights that is small beside the layer's matmuls.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Literal

import torch
from torch import nn

from configs.schema import Config
from learner.lora import apply_lora
from system.policy import SamplingConfig


def learner_device(cfg: Config) -> torch.device:
    """CUDA when the learner's resources ask for a GPU (Ray then sets CUDA_VISIBLE_DEVICES to the one it
    gave, so it is cuda:0 here), CPU otherwise."""
    if cfg.resources.learner.num_gpus <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"resources.learner.num_gpus = {cfg.resources.learner.num_gpus} but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); set it to 0 to train on the CPU"
        )
    return torch.device("cuda", torch.cuda.current_device())


def prepare_model(model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
    """Moves the model to `device` in float32 (the master weights), turns dropout off (the first mini-batch
    must run exactly at θ_old), enables gradient checkpointing and LoRA (frozen base, adapters made on the
    device in fp32) when configured."""
    model.to(device=device, dtype=torch.float32)
    apply_lora(model, cfg.learner.lora)
    if cfg.learner.grad_checkpointing:
        # HF checkpoints its decoder layers only in train mode; non-reentrant, so kwargs (the tree plan)
        # pass through and no input needs requires_grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        _silence_dropout(model)
    else:
        model.eval()
    return model


def _silence_dropout(model: nn.Module) -> None:
    """Train mode without randomness: every dropout module at p = 0 and the attention dropout of the config
    at 0 (a model with none is left as it is)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "attention_dropout", 0.0):
        config.attention_dropout = 0.0


@contextlib.contextmanager
def compute_scope(device: torch.device, precision: str) -> Iterator[None]:
    """bf16 autocast on `device` for precision = bfloat16 (no weight cache: module docstring); nothing for
    float32."""
    bf16 = precision == "bfloat16"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
        yield


def attention_for(cfg: Config, device: torch.device) -> Literal["tree", "flex"]:
    """`learner.tree_attention`: auto = flex on CUDA (no backward on the CPU), the chunked plan elsewhere."""
    choice = cfg.learner.tree_attention
    if choice == "flex" and device.type != "cuda":
        raise ValueError(
            "learner.tree_attention = flex needs a CUDA learner (FlexAttention has no CPU backward)"
        )
    return "flex" if choice == "flex" or (choice == "auto" and device.type == "cuda") else "tree"


def adamw(model: nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the fp32 master weights; on CUDA the fused kernel for a one-process learner: one launch
    per step and no temporaries (the foreach kernel's intermediates are another copy of the parameters,
    16 GB for a 4B model, at the step's peak). Sharded (DTensor) parameters keep the foreach kernel. Only
    the parameters that train: with LoRA the adapters, and no moments for the frozen base."""
    from torch.distributed.tensor import DTensor

    trained = [p for p in model.parameters() if p.requires_grad]
    sharded = any(isinstance(p, DTensor) for p in trained)
    fused = device.type == "cuda" and not sharded
    return torch.optim.AdamW(
        trained, lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay, fused=fused or None
    )


def warmup_lr(optimizer: torch.optim.Optimizer, base_lrs: list[float], version: int, warmup: int) -> None:
    """Linear warmup over `warmup` learner steps; a function of the version, so a resumed run continues the
    same schedule."""
    scale = min(1.0, (version + 1) / warmup) if warmup else 1.0
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * scale


def learner_sampling(cfg: Config) -> SamplingConfig:
    """The distribution π is scored under: μ's (`sampler.*`), at `learner.temperature` where that is set."""
    base = SamplingConfig.of(cfg.sampler)
    t = cfg.learner.temperature
    return base if t is None else dataclasses.replace(base, temperature=t)
