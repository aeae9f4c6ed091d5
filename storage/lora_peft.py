"""Our LoRA adapter (system/lora_sync.py: `<layer>.lora_A` [r, in], `<layer>.lora_B` [out, r], scaling
alpha/r) as a PEFT-format folder and back: what vLLM's LoRA loader reads (a vLLM sampler writes one per
version, actors/policy/vllm_lora.py) and what `treeopsd export` writes beside the merged model.

    write_peft(folder, tensors, scaling=2.0, rank=8, base_model="HuggingFaceTB/SmolLM2-135M", fingerprint=fp)
    tensors, meta = read_peft(folder)    # our names back; meta: rank, alpha, scaling, target_modules, ...

The folder holds `adapter_config.json` (peft_type LORA, r, lora_alpha = scaling·r, target_modules = the
adapted layers' last name parts, base_model_name_or_path, bias "none") and `adapter_model.safetensors`, the
tensors named as PEFT names them, `base_model.model.<layer>.lora_A.weight` (the model's own module path
under PEFT's two wrappers). The base's fingerprint goes into the safetensors header's `__metadata__`
(strings only, ignored by PEFT and vLLM), not into the JSON, whose unknown keys PEFT versions warn about.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from system.lora_sync import ADAPTER_NAMES, AdapterMismatch, adapter_layers

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX, SUFFIX = "base_model.model.", ".weight"


def target_modules(tensors: Mapping[str, Any]) -> list[str]:
    """The adapted layers' last name parts, sorted (`q_proj`, ...): PEFT's and vLLM's target_modules."""
    return sorted({layer.rsplit(".", 1)[-1] for layer in adapter_layers(tensors)})


def peft_config(
    tensors: Mapping[str, Any], scaling: float, rank: int, base_model: str | None
) -> dict[str, Any]:
    """adapter_config.json's content for these tensors (see the module docstring)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": float(scaling) * int(rank),
        "lora_dropout": 0.0,
        "target_modules": target_modules(tensors),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def peft_tensors(tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Our names -> PEFT's (`<layer>.lora_A` -> `base_model.model.<layer>.lora_A.weight`), CPU contiguous."""
    adapter_layers(tensors)  # one line refuses a name that is not a layer's lora_A or lora_B
    out = {}
    for name, value in tensors.items():
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        out[f"{PREFIX}{name}{SUFFIX}"] = t.detach().to("cpu").contiguous()
    return out


def write_peft(
    folder: str | Path,
    tensors: Mapping[str, Any],
    *,
    scaling: float,
    rank: int,
    base_model: str | None = None,
    fingerprint: str | None = None,
) -> Path:
    """Writes the PEFT folder (created if missing; its two files replaced) and returns it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt"}
    if fingerprint is not None:
        metadata["base_fingerprint"] = fingerprint
    save_file(peft_tensors(tensors), str(folder / WEIGHTS), metadata=metadata)
    config = peft_config(tensors, scaling, rank, base_model)
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def read_peft(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(our-named tensors, meta) of a PEFT LoRA folder: meta has rank, alpha, scaling (alpha/r; rsLoRA:
    alpha/√r), target_modules, base_model and base_fingerprint (None unless we wrote it). One line refuses
    a folder that is not a plain LoRA adapter."""
    from safetensors import safe_open

    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise AdapterMismatch(f"{folder}: not a PEFT adapter folder (want {CONFIG} and {WEIGHTS})")
    cfg = json.loads((folder / CONFIG).read_text())
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("bias", "none") != "none":
        raise AdapterMismatch(f"{folder}: only plain LoRA adapters (no DoRA, no bias) are read")
    rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    tensors = {}
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        header = f.metadata() or {}
        for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            if not (key.startswith(PREFIX) and key.endswith(SUFFIX)):
                raise AdapterMismatch(f"{folder}: tensor {key!r} is not a PEFT LoRA weight")
            name = key[len(PREFIX) : -len(SUFFIX)]
            if name.rsplit(".", 1)[-1] not in ADAPTER_NAMES:
                raise AdapterMismatch(f"{folder}: tensor {key!r} is not a layer's lora_A or lora_B")
            tensors[name] = f.get_tensor(key)
    meta = {
        "rank": rank,
        "alpha": alpha,
        "scaling": scale,
        "target_modules": cfg.get("target_modules"),
        "base_model": cfg.get("base_model_name_or_path"),
        "base_fingerprint": header.get("base_fingerprint"),
    }
    return tensors, meta


def remove_peft(folder: str | Path) -> None:
    """Deletes a folder `write_peft` made (its two files, then the folder); missing parts are fine."""
    folder = Path(folder)
    for name in (CONFIG, WEIGHTS):
        if (folder / name).exists():
            os.remove(folder / name)
    if folder.is_dir():
        folder.rmdir()
