"""The HF backend's lock-step decode step, with and without its two speed-ups, side by side in one run
(part of `treeopsd bench sampler`'s JSON as `hf_decode`).

A random-init model of SmolLM2-135M's dimensions (the real demo's model: 30 layers, 576 wide, 9 query over
3 K/V heads), one thread, `rows` requests of ~`context` tokens decoding `new` tokens each in one `sample`
call. Four layouts, each timed per decode step (hf_batch.step; the median step, so a burst of load on a
shared machine moves it little), interleaved `repeats` times with the best kept:

- `baseline`: transformers' sdpa (K/V repeated per query head under a mask) and a concatenating cache;
- `grouped`: the grouped sdpa (actors/policy/grouped_attention.py) only;
- `roomy`: the in-place cache (hf_batch.RoomyLayer) only;
- `both`: what the backend does.

`same_ids` says whether all four drew the same tokens (they must: neither speed-up changes a number).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

LAYOUTS = ("baseline", "grouped", "roomy", "both")


def _model(quick: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=8 if quick else 30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def _concatenating(layers: list[tuple[torch.Tensor, torch.Tensor]], config: object) -> DynamicCache:
    return DynamicCache(layers, config=config) if layers else DynamicCache(config=config)


def _decode_ms(model: Any, layout: str, contexts: list[list[int]], new: int) -> tuple[float, list]:
    """The median ms of a decode step of one lock-step call in `layout`, and the ids it drew."""
    from actors.policy import hf_batch
    from actors.policy.hf_backend import HFBackend
    from system.policy import SampleRequest, SamplingConfig

    spent: list[float] = []
    step, roomy = hf_batch.step, hf_batch.roomy

    def timed(*args: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = step(*args)
        spent.append(time.perf_counter() - t0)
        return out

    hf_batch.step = timed  # type: ignore[assignment]
    if layout in ("baseline", "grouped"):
        hf_batch.roomy = _concatenating  # type: ignore[assignment]
    try:
        backend = HFBackend(model, sampling=SamplingConfig(seed=0))  # switches to the grouped sdpa
        if layout in ("baseline", "roomy"):
            model.set_attn_implementation("sdpa")
        results = backend.sample([SampleRequest(c, new, (-1,)) for c in contexts])
    finally:
        hf_batch.step, hf_batch.roomy = step, roomy  # type: ignore[assignment]
    return statistics.median(spent) * 1000, [r.token_ids for r in results]


def measure(quick: bool) -> dict[str, Any]:
    rows, context, new, repeats = (4, 100, 16, 1) if quick else (8, 400, 48, 2)
    torch.set_num_threads(1)
    model = _model(quick)
    gen = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 49152, (context + 7 * i,), generator=gen).tolist() for i in range(rows)]
    best: dict[str, float] = {}
    ids: dict[str, list] = {}
    for _ in range(repeats):
        for layout in LAYOUTS:
            ms, ids[layout] = _decode_ms(model, layout, contexts, new)
            best[layout] = min(ms, best.get(layout, ms))
    return {
        "layers": model.config.num_hidden_layers,
        "rows": rows,
        "context_tokens": context,
        "new_tokens": new,
        **{f"step_ms_{k}": round(v, 1) for k, v in best.items()},
        "speedup": round(best["baseline"] / best["both"], 2),
        "same_ids": all(ids[k] == ids["baseline"] for k in LAYOUTS),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
