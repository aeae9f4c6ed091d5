"""Tree attention through torch FlexAttention: the CUDA path (`learner.tree_attention = flex`, auto on CUDA).

The mask is a function of the packed batch's `reach` alone (learner/packing.py): key kv is visible to query q
iff kv ≤ q < reach[kv] (kv's later tokens in its node and every descendant), plus q = kv so that padding
attends to itself.

**The BlockMask is built from the intervals, not from the mask function.** A tree's keys are intervals
[kv, reach[kv]) of queries, so a 128×128 block (query block qb, key block kb < qb) is

    empty  when max(reach over kb) ≤ first query of qb    (no key of kb reaches that far)
    full   when min(reach over kb) ≥ end of qb            (every key of kb reaches past the block)
    partial otherwise, and always on the diagonal         (the mask function decides token by token)

which is two [blocks] reductions and one [q blocks × k blocks] comparison on the GPU: no T×T tensor, no
`create_block_mask` (whose compiled form recompiles for every new length), no host work per element.

**Lengths in buckets.** `torch.compile(flex_attention, dynamic=False)` builds one kernel per sequence
length (forward and backward, tens of seconds each on a GPU), and token-budget micro-batches have a new
length almost every time. The learner therefore pads each micro-batch (`pad_to_length`, learner/packing.py)
to the smallest of `BUCKETS` lengths, budget·(1/2, 3/4, 7/8, 1) rounded up to the 128-token block: a run
compiles at most once per bucket (a piece over budget alone adds one per multiple of half the budget).
Padding tokens attend to themselves only (one diagonal block each: ~no attention work), carry no loss, and
are reported as `learner/pad_frac`; `learner/compiles` counts the graphs torch.compile built in the process.

Measured in torch 2.13: FlexAttention has no backward on the CPU (`NotImplementedError: FlexAttention does
not support backward on CPU`), so on the CPU the chunked plan is the path and flex is only checked forward
(eager, or compiled forward as a proxy of the compile count) against it; on CUDA the compiled kernel runs
forward and backward (tests marked `gpu`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

FLEX_TREE_ATTENTION = "treeopsd_flex"
BLOCK = 128  # FlexAttention's block size: lengths are padded to multiples of it
BUCKETS = 4  # compiled lengths per token budget: the budget's quarters
_COMPILED: dict[str, Any] = {}


def bucket_lengths(budget: int, buckets: int = BUCKETS) -> list[int]:
    """The lengths a budget's micro-batches are padded to, each a multiple of the block: halving the gap
    to the budget, budget·(1/2, 3/4, 7/8, 1) for 4, since first-fit-decreasing fills most micro-batches close
    to the budget (on the GPU bench's trees: 9 % padding against 14 % for equal quarters). Budget ≤ 0, no
    budget: none (`bucket_length` then uses powers of two)."""
    if budget <= 0:
        return []
    fractions = [1 - 2.0**-k for k in range(1, buckets)] + [1.0]  # 1/2, 3/4, 7/8, ..., 1
    return sorted({math.ceil(budget * f / BLOCK) * BLOCK for f in fractions})


def bucket_length(tokens: int, budget: int, buckets: int = BUCKETS) -> int:
    """The padded length of a micro-batch of `tokens`: the smallest bucket that holds it; over the budget
    (a piece too long alone) the next multiple of half the budget; without a budget the next power of two
    (at least one block)."""
    lengths = bucket_lengths(budget, buckets)
    if not lengths:
        return max(BLOCK, 1 << max(0, tokens - 1).bit_length())
    for length in lengths:
        if tokens <= length:
            return length
    return math.ceil(tokens / lengths[0]) * lengths[0]


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process (dynamo's own counter): the learner reports it as
    `learner/compiles`, and a bucketing scheme is judged by how little it grows."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def block_tables(reach: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) [B, nq, nk] bool block tables of a batch's `reach` [B, T]: the module docstring's
    rule, computed where `reach` lives. A last partial block is completed with self-only columns (the
    kernel masks columns past T itself)."""
    b, t = reach.shape
    n = -(-t // block)
    tail = torch.arange(t, n * block, device=reach.device) + 1
    blocks = torch.cat([reach, tail.expand(b, -1)], dim=1).view(b, n, block)
    max_reach, min_reach = blocks.amax(-1), blocks.amin(-1)  # [B, nk]
    first_q = torch.arange(n, device=reach.device) * block  # [nq]
    below = torch.ones(n, n, dtype=torch.bool, device=reach.device).tril(-1)  # kb < qb
    reaches = max_reach[:, None, :] > first_q[None, :, None]  # some key of kb sees into qb
    full = below & (min_reach[:, None, :] >= (first_q + block)[None, :, None])
    partial = (below & reaches & ~full) | torch.eye(n, dtype=torch.bool, device=reach.device)
    return partial, full


def _kv_lists(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [B, nq, nk] block table as FlexAttention's (counts [B, 1, nq], indices [B, 1, nq, nk]) int32: the
    chosen key blocks of each query block first, in ascending order."""
    counts = table.sum(-1, dtype=torch.int32)
    order = torch.argsort(table.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[:, None], order.to(torch.int32)[:, None]


def tree_block_mask(reach: torch.Tensor, device: torch.device | str) -> Any:
    """BlockMask [B, 1, T, T] of a tree-packed batch from its `reach` [B, T]."""
    from torch.nn.attention.flex_attention import BlockMask

    reach = reach.to(device)
    t = reach.shape[1]

    def visible(batch, head, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        # clamped: the kernel may evaluate the columns of a last partial block, past T, then masks them
        return (kv_idx <= q_idx) & ((q_idx < reach[batch, kv_idx.clamp(max=t - 1)]) | (q_idx == kv_idx))

    partial, full = block_tables(reach)
    kv_num, kv_idx = _kv_lists(partial)
    full_num, full_idx = _kv_lists(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=visible, seq_lengths=(t, t)
    )


def _kernel(device: torch.device) -> Any:
    """flex_attention compiled once per process on CUDA (one graph per bucket length); the eager (unfused,
    forward-only) one on the CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED:
        # a few buckets × (grad, no grad) stay far below dynamo's limit; raise it anyway so that a run with
        # many over-budget lengths recompiles instead of falling back to the unfused T×T kernel
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), 64))
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
    """transformers attention interface: query [B, H, T, D], key/value [B, Hkv, T, D] → [B, T, H, D].

    Under bf16 autocast the rotary embedding leaves q and k in fp32 (fp32 cos/sin) while v is bf16: the
    kernel takes one dtype, so all three run in v's (the matmul dtype autocast chose)."""
    if block_mask is None:
        raise ValueError(f"attn_implementation {FLEX_TREE_ATTENTION!r} needs the block_mask kwarg")
    if dropout:
        raise ValueError("flex tree attention runs without attention dropout (the learner turns it off)")
    dtype = value.dtype
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
    query, key, value = (x.to(dtype) for x in (query, key, value))
    gqa = query.shape[1] != key.shape[1]
    with warnings.catch_warnings():  # the CPU's eager kernel warns that it is unfused: that is the point
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = _kernel(query.device)(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX_TREE_ATTENTION, flex_tree_attention_forward)
