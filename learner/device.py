"""Where and how the learner computes: its device, bf16 autocast, gradient checkpointing (docs/design.md §11).

    device = learner_device(cfg)            # cuda when resources.learner.num_gpus > 0, else cpu
    prepare_model(model, cfg, device)       # moved there, fp32 master weights, dropout off, checkpointing
    with compute_scope(device, cfg.learner.precision): forward      # bf16 autocast or nothing

Mixed precision is autocast over fp32 parameters: matmuls run in bf16, the parameters, their gradients and
AdamW's state stay fp32 (what "fp32 master weights" means without a second copy), and the log-softmax of the
sampled tokens and every loss run in fp32 (learner/forward.py computes the LM head outside autocast).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from configs.schema import Config


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
    must run exactly at θ_old) and enables gradient checkpointing when configured."""
    model.to(device=device, dtype=torch.float32)
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
    """bf16 autocast on `device` for precision = bfloat16; nothing for float32."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
        yield
