"""Per-token log-probs of a packed batch under an HF causal LM (tree-packed or path-by-path).

    logp = token_logprobs(model, pack_trees(trees))    # [B, T]; 0 off the loss tokens
    ref = path_logprobs(model, pack_paths(trees))      # the same numbers, one causal row per leaf

The decoder runs once over the batch; log-softmax is taken only at the columns that predict a loss token
(`target_index`), so the LM head costs O(loss tokens · vocab) instead of O(all tokens · vocab).

Attention for a tree-packed batch, `attention=`:

* "tree" (default): `learner.tree_attention`, block-sparse SDPA over query chunks that never builds the T×T
  mask; same numbers, and the work is Σ chunk·|path| instead of T² (what makes packing pay off on CPU).
* "flex": torch FlexAttention with a BlockMask from the batch's `reach` (learner/flex_attention.py), the GPU
  fast path; forward-only on the CPU.
* "mask": the model's own eager/sdpa attention with the 4D *additive float* mask ([B, 1, T, T],
  0 / dtype-min) and the depth-based `position_ids`. transformers 5.19 hands a 4D mask to the attention
  function unchanged (`masking_utils._preprocess_mask_arguments` returns early for any 4D tensor); "eager"
  adds it to the scores, "sdpa" passes it as `attn_mask`, and both give path-by-path logits
  (docs/design.md §10.12: 2.2e-16 in float64; a *boolean* 4D mask broke eager). Flash-attention kernels take
  no arbitrary mask: do not use them here.

Both give the same numbers for any batch (tests/unit/test_packing.py).
Path rows are right-padded plain causal sequences: real tokens never see the padding, so no mask is needed.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from learner.flex_attention import FLEX_TREE_ATTENTION, tree_block_mask
from learner.lm_head import sampled_token_logprobs
from learner.packing import PackedBatch
from learner.tree_attention import TREE_ATTENTION, TreePlan, build_plan, use_attention
from system.policy import SamplingConfig
from system.sampling import sampling_logprobs

# the HF backend's grouped sdpa (actors/policy/grouped_attention.py) takes sdpa's masks: a model evaluated
# through that backend switched to it
TREE_MASK_ATTENTION = ("eager", "sdpa", "treeopsd_grouped_sdpa")


def tree_plan(packed: PackedBatch, chunk: int = 32) -> TreePlan:
    """The block-sparse attention plan of a tree-packed batch, built once per batch (kept in its cache)."""
    if packed.segments is None:
        raise ValueError("tree attention needs a tree-packed batch (pack_trees)")
    key = ("plan", chunk)
    if key not in packed._cache:
        packed._cache[key] = build_plan(
            packed.segments, packed.input_ids.numel(), packed.input_ids.shape[1], chunk
        )
    return packed._cache[key]


def _check_attention(model: nn.Module) -> None:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is not None and impl not in TREE_MASK_ATTENTION:
        raise ValueError(
            f"attn_implementation={impl!r} takes no custom 4D float mask; use one of {TREE_MASK_ATTENTION}"
        )


ATTENTIONS = {"tree": TREE_ATTENTION, "flex": FLEX_TREE_ATTENTION, "mask": None}


def attention_scope(
    model: nn.Module, packed: PackedBatch, attention: str
) -> contextlib.AbstractContextManager:
    """The model's attention switched to the tree kernel for a tree-packed batch. Hold it over forward *and*
    backward: gradient checkpointing re-runs the layers inside backward, and they must find the same
    kernel there (a plain causal kernel would silently compute other gradients)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {sorted(ATTENTIONS)}, got {attention!r}")
    impl = ATTENTIONS[attention]
    if packed.segments is None or impl is None:
        return contextlib.nullcontext()
    return use_attention(model, impl)


def _hidden_states(model: nn.Module, packed: PackedBatch, attention: str) -> torch.Tensor:
    """Last hidden states [B, T, H] of the decoder stack (no LM head)."""
    decoder = model.get_decoder()
    param = next(model.parameters())
    inputs = {
        "input_ids": packed.input_ids.to(param.device),
        "position_ids": None if packed.position_ids is None else packed.position_ids.to(param.device),
        "use_cache": False,
    }
    if packed.segments is None:  # plain causal rows
        return decoder(**inputs).last_hidden_state
    with attention_scope(model, packed, attention):
        if attention == "tree":
            return decoder(**inputs, tree_plan=tree_plan(packed)).last_hidden_state
        if attention == "flex":
            key = ("flex", str(param.device))
            if key not in packed._cache:
                packed._cache[key] = tree_block_mask(packed.reach, param.device)
            return decoder(**inputs, block_mask=packed._cache[key]).last_hidden_state
    _check_attention(model)
    mask = packed.additive_mask(param.dtype).to(param.device)
    return decoder(**inputs, attention_mask=mask).last_hidden_state


def token_logprobs(
    model: nn.Module,
    packed: PackedBatch,
    attention: str = "tree",
    sampling: SamplingConfig | None = None,
    chunk_tokens: int = 0,
    tf32_head: bool = False,
) -> torch.Tensor:
    """[B, T] float32 log π(y_t | h_t) at every loss-token copy (turn_ids ≥ 0), 0 elsewhere; differentiable.

    π is the *sampling distribution* of the model (`system/sampling.py`: temperature, top-k, top-p, the
    sampled token always in the support), the one the sampler's stored log-probs describe; None: the model's
    own distribution. Works for both layouts (`pack_trees`: 4D tree mask + depth positions; `pack_paths`:
    plain causal rows). `chunk_tokens` > 0: the LM head runs that many loss tokens at a time and recomputes
    them in backward (learner/lm_head.py), so no tensor over [chunk × vocab] exists; 0: all at once;
    `tf32_head`: its fp32 matmuls on TF32 tensor cores (the bf16 learner's choice).
    """
    hidden = _hidden_states(model, packed, attention)
    rows, cols = torch.nonzero(packed.turn_ids >= 0, as_tuple=True)
    src = packed.target_index[rows, cols]
    dev = hidden.device
    h = hidden[rows.to(dev), src.to(dev)]  # [n, H]: the state that predicts each loss token
    labels = packed.input_ids[rows, cols].to(dev)
    head = model.get_output_embeddings()
    # within one chunk the plain path below is that chunk without the backward's recompute (fp32 learners;
    # the bf16 one keeps the chunked head for its TF32 matmuls)
    if chunk_tokens > 0 and (tf32_head or chunk_tokens < h.shape[0]):
        lp = sampled_token_logprobs(h, head, labels, sampling, chunk_tokens, tf32=tf32_head)
    else:
        with torch.autocast(dev.type, enabled=False):  # the LM head and log-softmax in fp32 (also under bf16)
            logits = head(h.float()).float()
        dist = sampling_logprobs(logits, sampling, keep=labels) if sampling else torch.log_softmax(logits, -1)
        lp = dist.gather(1, labels[:, None])[:, 0]
    out = torch.zeros(packed.turn_ids.shape, dtype=torch.float32, device=dev)
    return out.index_put((rows.to(dev), cols.to(dev)), lp)


def path_logprobs(model: nn.Module, paths: PackedBatch) -> torch.Tensor:
    """Reference: `token_logprobs` over `pack_paths` rows (ordinary causal sequences, no custom mask)."""
    if paths.segments is not None or paths.position_ids is not None:
        raise ValueError("path_logprobs expects pack_paths output (plain causal rows)")
    return token_logprobs(model, paths)


def full_logits_logprobs(model: nn.Module, paths: PackedBatch) -> torch.Tensor:
    """Slow reference through the model's own forward (full logits, shifted labels), one row at a time."""
    out = torch.zeros(paths.turn_ids.shape, dtype=torch.float32)
    for b in range(paths.input_ids.shape[0]):
        n = int(paths.valid[b].sum())
        ids = paths.input_ids[b : b + 1, :n]
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        on = paths.turn_ids[b, 1:n] >= 0
        out[b, 1:n] = torch.where(on, lp, 0.0)
    return out
