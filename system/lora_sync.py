"""Adapter-only weight sync: what a LoRA learner publishes instead of merged weights, and the base fingerprint
both sides compute (the learner in learner/lora.py, the HF sampler in actors/policy/hf_lora.py).

With `learner.lora.rank > 0` and HF samplers the learner publishes, per adapted layer, `<layer>.lora_A`
[r, in] and `<layer>.lora_B` [out, r] alone, as any version (system/weight_codec.py: same chunks, checksums,
no pickle), with the header's "meta" saying what they are::

    {"kind": "lora_adapter", "scaling": alpha / r, "rank": r, "base_fingerprint": "<16 hex>"}

A sampler merges W = W_base + scaling·B·A into each layer's weight, from an untouched copy of W_base, so a
version replaces the last one and never adds to it; it refuses an adapter whose base fingerprint is not its
own model's. Version 0 is the adapter too (B = 0: the sampler's own base, checked there already).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from system.weight_wire import NamedWeights

ADAPTER_KIND = "lora_adapter"
ADAPTER_NAMES = ("lora_A", "lora_B")
FINGERPRINT_SAMPLES = 4096  # values read per base tensor, evenly strided over it


class AdapterMismatch(ValueError):
    """A received adapter that does not fit this sampler's model (another base, or other layers): one line."""


def fingerprint(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A hash of the parameters' names, shapes and FINGERPRINT_SAMPLES evenly strided values of each (exact
    values, no sums: the same on every device and thread count), adapter tensors left out. The same base in
    the same dtype gives the same fingerprint in the learner and in a sampler."""
    h = hashlib.sha256()
    for name, p in sorted(named_parameters, key=lambda item: item[0]):
        if name.rsplit(".", 1)[-1] in ADAPTER_NAMES:
            continue
        flat = p.detach().reshape(-1)
        n = flat.numel()
        idx = torch.linspace(0, max(n - 1, 0), min(n, FINGERPRINT_SAMPLES), device=flat.device).long()
        h.update(f"{name}:{tuple(p.shape)};".encode())
        h.update(flat[idx].to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()[:16]


def adapter_message(tensors: Mapping[str, Any], scaling: float, rank: int, base: str) -> NamedWeights:
    """The adapter tensors as a version to publish, the header's meta saying what they are (see above)."""
    meta = {"kind": ADAPTER_KIND, "scaling": float(scaling), "rank": int(rank), "base_fingerprint": base}
    return NamedWeights(tensors, meta)


def is_adapter(named: Mapping[str, Any]) -> bool:
    """Whether a received version is a LoRA adapter (else: whole weights under the model's names)."""
    return getattr(named, "meta", {}).get("kind") == ADAPTER_KIND


def adapter_layers(named: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """layer name -> (A, B) of an adapter message; one line refuses a name that is not a layer's A or B, or a
    layer with one of the two only."""
    layers: dict[str, dict[str, Any]] = {}
    for name, value in named.items():
        layer, _, part = name.rpartition(".")
        if part not in ADAPTER_NAMES or not layer:
            raise AdapterMismatch(f"LoRA adapter: {name!r} is not a layer's lora_A or lora_B")
        layers.setdefault(layer, {})[part] = value
    half = sorted(layer for layer, parts in layers.items() if len(parts) != 2)
    if half:
        raise AdapterMismatch(f"LoRA adapter: layer {half[0]!r} has only one of lora_A and lora_B")
    return {layer: (parts["lora_A"], parts["lora_B"]) for layer, parts in layers.items()}
