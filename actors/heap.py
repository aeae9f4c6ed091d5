"""Keeping the garbage collector off a role's long-lived heap.

A sampler process holds its engine, model, tokenizer, environment and index for its whole life: about
770,000 tracked objects with vLLM here. CPython's full (generation-2) collection walks all of them, about
0.5 s each time on this machine, and a full collection comes every few rounds of allocation; on the
sampler's event loop that is half a second in which no episode advances and no request reaches the engine
(`bench sampler`'s `sampler_64_*`: a round of 1.5 s took 2 s when one landed in it). `gc.freeze()` after
start-up moves what exists then into a permanent generation that collections skip; what sampling allocates
is collected as before, and a frozen object still goes when its last reference does (only a frozen cycle
would stay: the start-up heap is collected once first). vLLM's engine core freezes its own heap after
start-up the same way (vllm/v1/engine/core.py); this is the client side, where the agent loop runs.
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> int:
    """Collects once, then freezes every object alive now; returns how many are frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
