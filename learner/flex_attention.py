"""Tree attention through torch FlexAttention: the GPU fast path (`learner.tree_attention = flex`).

The mask is a function of the packed batch's `reach` alone (learner/packing.py): key kv is visible to query q
iff kv ≤ q < reach[kv] (kv's later tokens in its node and every descendant), plus q = kv so that padding
attends to itself. `create_block_mask` turns it into a BlockMask (which 128×128 blocks are empty, full or
partial); the compiled kernel skips empty blocks, so the work follows the tree, like the chunked SDPA plan
(learner/tree_attention.py), and no T×T tensor is kept.

Measured in torch 2.13: FlexAttention has no backward on the CPU (`NotImplementedError: FlexAttention does
not support backward on CPU`), so on the CPU the chunked plan is the path and flex is only checked forward
(eager, unfused) against it; on CUDA the compiled kernel runs forward and backward (tests marked `gpu`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

FLEX_TREE_ATTENTION = "treeopsd_flex"
_COMPILED: dict[str, Any] = {}


def tree_block_mask(reach: torch.Tensor, device: torch.device | str) -> Any:
    """BlockMask [B, 1, T, T] of a tree-packed batch from its `reach` [B, T]."""
    from torch.nn.attention.flex_attention import create_block_mask

    reach = reach.to(device)
    b, t = reach.shape

    def visible(batch, head, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (kv_idx <= q_idx) & ((q_idx < reach[batch, kv_idx]) | (q_idx == kv_idx))

    on_gpu = torch.device(device).type == "cuda"
    return create_block_mask(visible, b, None, t, t, device=str(device), _compile=on_gpu)


def _kernel(device: torch.device) -> Any:
    """flex_attention compiled once per process on CUDA; the eager (unfused, forward-only) one on the CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["cuda"]


def flex_tree_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    block_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query [B, H, T, D], key/value [B, Hkv, T, D] → [B, T, H, D]."""
    if block_mask is None:
        raise ValueError(f"attn_implementation {FLEX_TREE_ATTENTION!r} needs the block_mask kwarg")
    if dropout:
        raise ValueError("flex tree attention runs without attention dropout (the learner turns it off)")
    gqa = query.shape[1] != key.shape[1]
    with warnings.catch_warnings():  # the CPU's eager kernel warns that it is unfused: that is the point
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = _kernel(query.device)(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX_TREE_ATTENTION, flex_tree_attention_forward)
