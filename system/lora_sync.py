"""Adapter-only weight sync: what a LoRA learner publishes instead of merged weights, and the base fingerprint
both sides compute (the learner in learner/lora.py, the HF sampler in actors/policy/hf_lora.py, the vLLM
sampler in actors/policy/vllm_lora.py).

With `learner.lora.rank > 0` (`samplers_load_adapters`) the learner publishes, per adapted layer,
`<layer>.lora_A` [r, in] and `<layer>.lora_B` [out, r] alone, as any version (system/weight_codec.py: same
chunks, checksums, no pickle), with the header's "meta" saying what they are::

    {"kind": "lora_adapter", "scaling": alpha / r, "rank": r, "base_fingerprint": "<16 hex>"}

A sampler merges W = W_base + scaling·B·A into each layer's weight, from an untouched copy of W_base, so a
version replaces the last one and never adds to it; it refuses an adapter whose base fingerprint is not its
own model's. A vLLM sampler loads each version as a vLLM LoRA adapter of its own instead (a PEFT folder,
storage/lora_peft.py). Version 0 is the adapter too (B = 0: the sampler's own base, checked there already).
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
    return fingerprint_of({name: (tuple(p.shape), sampled(p)) for name, p in named_parameters})


def sampled(t: torch.Tensor) -> torch.Tensor:
    """The FINGERPRINT_SAMPLES evenly strided values of `t` that `fingerprint` reads, in t's dtype, flat."""
    flat = t.detach().reshape(-1)
    return flat[sample_indices(flat.numel()).to(flat.device)]


def sample_indices(n: int) -> torch.Tensor:
    """min(n, FINGERPRINT_SAMPLES) indices from 0 to n - 1, evenly strided, in integer arithmetic: a float32
    linspace rounds n - 1 up to n past 2**24 elements (SmolLM2's embedding has 28,311,552)."""
    k = min(n, FINGERPRINT_SAMPLES)
    return torch.arange(k, dtype=torch.int64) * max(n - 1, 0) // max(k - 1, 1)


def fingerprint_of(parts: Mapping[str, tuple[tuple[int, ...], torch.Tensor]]) -> str:
    """`fingerprint` from name -> (shape, `sampled` values) (a vLLM sampler reads these from the checkpoint's
    files without loading them, actors/policy/vllm_lora.py)."""
    h = hashlib.sha256()
    for name, (shape, values) in sorted(parts.items()):
        if name.rsplit(".", 1)[-1] in ADAPTER_NAMES:
            continue
        h.update(f"{name}:{tuple(shape)};".encode())
        h.update(values.to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()[:16]


def samplers_load_adapters(cfg: Any) -> bool:
    """Whether a LoRA run's samplers take adapters (HF always; vLLM unless `sampler.engine.enable_lora` is
    set false, the fallback to merged weights): the learner publishes adapters then, and vLLM samplers
    start their engine with LoRA (actors/sampler_setup.py)."""
    return cfg.sampler.backend == "hf" or (cfg.sampler.engine or {}).get("enable_lora", True) is not False


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
