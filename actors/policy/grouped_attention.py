"""transformers' SDPA attention without copying K/V once per query head (grouped-query models, CPU).

With an attention mask, transformers' `sdpa` path repeats each K/V head for its group of query heads
(`repeat_kv`: a copy of the whole cache in every layer on every step) unless the device is CUDA-like with
no mask. torch's CPU kernel takes the groups as they are (`enable_gqa=True`) and gives the same numbers.
The HF backend always decodes with a mask (its rows are left-padded), so there the copy was most of the
attention's time: 8 rows × 450 cached tokens, SmolLM2-135M's 9 query over 3 K/V heads, one thread, an
attention call took 8.2 ms with the copy and 2.6 ms without (beside two busy processes). `treeopsd bench
sampler` times a whole decode step with and without it (`hf_decode`).

`use_grouped_attention(model)` switches a model from `sdpa` to this implementation (same mask format, same
outputs, gradients too); any other implementation (eager, flex, flash) is left alone.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "treeopsd_grouped_sdpa"  # learner/forward.py's TREE_MASK_ATTENTION names it too


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Query [B, H, Q, D], key and value [B, H_kv, L, D] (H a multiple of H_kv) → ([B, Q, H, D], None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal  # as transformers' sdpa decides
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the mask sdpa gets, so the same numbers


def use_grouped_attention(model: PreTrainedModel) -> bool:
    """Switches `model` (on CPU, with fewer K/V heads than query heads) from sdpa to `grouped_sdpa`;
    returns whether it did."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", heads)
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    if model.config._attn_implementation != "sdpa" or not on_cpu or kv_heads == heads:
        return False
    model.set_attn_implementation(NAME)
    return True
