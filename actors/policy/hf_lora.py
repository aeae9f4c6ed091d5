"""The HF sampler's side of adapter-only weight sync (system/lora_sync.py): a received LoRA adapter merged
into the model's weights in place, W = W_base + scaling·B·A, from an untouched copy of each adapted layer's
base weight, so the next version replaces this one instead of adding to it.

The base is the model as it stands when the first adapter arrives (what `model.path` loaded, or the last
whole-weights version): its fingerprint is taken then, before anything is merged, and an adapter trained on
another base is refused in one line. Every check runs before the first weight is written: a refused adapter
leaves the model as it was. Memory: one copy of each adapted weight (the base), kept from the first adapter.

    adapters = AdapterMerge()
    adapters.apply(model, received)   # received: an adapter version (is_adapter), meta in its header
    adapters.forget()                 # whole weights were loaded: they are the base from now on
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from system.lora_sync import AdapterMismatch, adapter_layers, fingerprint


class AdapterMerge:
    """See the module docstring. `base`: weight name -> its untouched base value (adapted layers only)."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.fingerprint: str | None = None

    def forget(self) -> None:
        """Whole weights were loaded over the model: they are the base of the next adapter."""
        self.base.clear()
        self.fingerprint = None

    def apply(self, model: nn.Module, adapter: Mapping[str, Any]) -> None:
        """Merges `adapter` (a NamedWeights with the adapter meta) into `model` in place; layers adapted by
        the previous version and not by this one go back to their base."""
        meta = getattr(adapter, "meta", {})
        if self.fingerprint is None:  # nothing merged yet: the model is its base
            self.fingerprint = fingerprint(model.named_parameters())
        if meta.get("base_fingerprint") != self.fingerprint:
            raise AdapterMismatch(
                f"LoRA adapter refused: it was trained on another base model (fingerprint "
                f"{meta.get('base_fingerprint')}, this sampler's is {self.fingerprint}); start the samplers "
                "from the learner's model.path"
            )
        merged = self._merged(model, adapter_layers(adapter), float(meta["scaling"]))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, weight in merged.items():
                if name not in self.base:  # the untouched base, copied once (not on every version)
                    self.base[name] = params[name].detach().clone()
                params[name].copy_(weight)
            for name in [n for n in self.base if n not in merged]:
                params[name].copy_(self.base.pop(name))

    def _merged(
        self, model: nn.Module, layers: dict[str, tuple[Any, Any]], scaling: float
    ) -> dict[str, torch.Tensor]:
        """weight name -> W_base + scaling·B·A in the weight's dtype (computed in fp32 at least); one line
        refuses a layer the model lacks or shapes that do not fit. Nothing is written here."""
        params = dict(model.named_parameters())
        out = {}
        for layer, (a, b) in layers.items():
            name = f"{layer}.weight"
            w = params.get(name)
            a, b = torch.as_tensor(a), torch.as_tensor(b)
            if w is None or w.dim() != 2:
                raise AdapterMismatch(f"LoRA adapter refused: this model has no Linear weight {name!r}")
            out_f, in_f = w.shape
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, a.shape[0]):
                raise AdapterMismatch(
                    f"LoRA adapter refused: {layer} has A {tuple(a.shape)} and B {tuple(b.shape)}, its "
                    f"weight is {tuple(w.shape)} (want A [r, {in_f}] and B [{out_f}, r])"
                )
            base = self.base.get(name, w.detach())
            work = torch.promote_types(w.dtype, torch.float32)
            a, b = a.to(w.device, work), b.to(w.device, work)
            out[name] = (base.to(work) + (b @ a) * scaling).to(w.dtype)
        return out
