"""LoRA in the learner: frozen base weights, a trained low-rank update B·A beside each target projection.

    model = apply_lora(model, cfg.learner.lora)   # in place (learner/device.py prepare_model, rank > 0)
    adapter_state(model)     # {"model.layers.0.self_attn.q_proj.lora_A": [r, in], ... .lora_B: [out, r]}
    merged_state(model)      # the base's state dict, W + (alpha/r)·B·A folded in: a plain HF model loads it
    base_fingerprint(model)  # names, shapes and sampled values of the frozen base: refuses a foreign adapter

**Why our own and not peft.** peft is not installed here (`pip list | grep -i peft`: nothing), and its
wrappers rename what they wrap (`q_proj.weight` becomes `q_proj.base_layer.weight`, the model itself
`base_model.model.…`). Three things key on the model's own parameter names: the weight broadcast (samplers
copy tensors into their model by name, §6), the checkpoints' `save_pretrained`/`from_pretrained` round trip
and DCP's shard names, and `treeopsd export`. `LoRALinear` is an `nn.Linear` that keeps its `weight` and
`bias` as they were and adds `lora_A` and `lora_B` beside them, so every base name stays what it was; the
whole adapter is this module (what peft adds beyond it, multiple adapters, other layer types, DoRA, is not
needed here).

**What trains and what is published.** `apply_lora` freezes every parameter of the model (embeddings, norms
and the LM head too) and adds the adapters, which are the only parameters requiring grad, so AdamW holds
state for them only (learner/device.py `adamw`). HF samplers get the adapter alone (`published_weights`:
lora_A/lora_B, scaling and the base's fingerprint; system/lora_sync.py) and merge it into their own copy of
the base; vLLM samplers get it too and load it as a vLLM LoRA adapter (actors/policy/vllm_lora.py), unless
`sampler.engine.enable_lora: false`: then whole weights under the base's names (`served_parameters` merges
each adapted layer, W + scale·B·A). B starts at zero, so the adapted model starts exactly at the base (the
first step runs at θ_old).

**Checkpoints.** `save_with_adapter` saves the merged weights as the checkpoint's model.safetensors (read
by `from_pretrained`, export and evaluation as any checkpoint) and the adapter beside it, with the base's
fingerprint, rank and alpha; `restore_with_adapter` refuses, in one line, an adapter of another base,
rank, alpha or layer set, or a checkpoint of the other kind, and then loads the adapter alone (exactly)
and AdamW's state. The fingerprint samples values instead of hashing every byte: a different base or
another fine-tune of it differs almost everywhere, and a sample costs nothing on billions of weights.

**On ranks** (`learner.ranks > 1`, learner/lora_sharded.py): FSDP2 shards the frozen base and the adapters
alike; the published adapter, `adapter_meta` and the DCP checkpoints are the same as one rank's, the adapter
gathered from its shards and the base's fingerprint computed once, before sharding (`KEPT_FINGERPRINT`).

**Dropout** (`learner.lora.dropout`, default 0) acts on the adapter's input in the passes that build a
gradient only: the learner keeps its model in eval mode (HF's own dropout off, §11), and its no-grad passes
(μ recomputed, π_prox, scoring) must see the deterministic adapted model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from configs.lora import LoraConfig
from storage.checkpoint import DCP_FORMAT, Adapter, Checkpoint, save_checkpoint
from storage.dcp_checkpoint import restore_dcp
from system.lora_sync import ADAPTER_NAMES, adapter_message, fingerprint, samplers_load_adapters
from system.weight_wire import NamedWeights

KEPT_FINGERPRINT = "lora_base_fingerprint"  # a sharded model's base fingerprint, kept from before sharding


class LoraError(ValueError):
    """An adapter that does not fit the model (another base, rank or layer set): one line, naming why."""


class LoRALinear(nn.Linear):
    """y = x·Wᵀ + b + (alpha/r)·dropout(x)·Aᵀ·Bᵀ with W and b frozen; A [r, in] Kaiming-uniform as nn.Linear
    initializes its weight, B [out, r] zero, so the layer starts as the base layer. The base's `weight` and
    `bias` stay this module's own parameters (the same tensors): their names do not change."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a second weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters, so the same names and storage
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.rank, self.alpha, self.dropout = rank, float(alpha), float(dropout)
        self.scaling = self.alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.dropout, training=torch.is_grad_enabled()) if self.dropout else x
        return out + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + (alpha/r)·B·A: the weight of a plain Linear that computes this layer (dropout aside)."""
        return self.weight + (self.lora_B @ self.lora_A) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}"


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted layers by module name, in module order (empty for a model without LoRA)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Freezes `model` and wraps, in place, each nn.Linear whose name ends with one of `cfg.target_modules`
    (at a dot) in a LoRALinear; the model back. rank 0: the model unchanged. A model already adapted with the
    same rank and alpha is returned as it is; one matching no target, or adapted otherwise, is refused."""
    if cfg.rank == 0:
        return model
    if done := lora_layers(model):
        first = next(iter(done.values()))
        if (first.rank, first.alpha) != (cfg.rank, cfg.alpha):
            why = f"rank {first.rank}, alpha {first.alpha}, not rank {cfg.rank}, alpha {cfg.alpha}"
            raise LoraError(f"the model already has LoRA layers of {why}")
        return model
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t) for t in cfg.target_modules)
    ]
    if not targets:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise LoraError(
            f"learner.lora.target_modules = {list(cfg.target_modules)} matches no nn.Linear of this model "
            f"(its Linear layers are named {', '.join(linears) or 'nothing'})"
        )
    _refuse_shared(model, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in targets:
        model.set_submodule(name, LoRALinear(linear, cfg.rank, cfg.alpha, cfg.dropout))
    return model


def _refuse_shared(model: nn.Module, targets: list[tuple[str, nn.Linear]]) -> None:
    """A target whose weight another module also holds (a tied LM head) would merge into both: refused."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor):
            owners.setdefault(id(w), []).append(name)
    for name, linear in targets:
        if len(set(owners[id(linear.weight)])) > 1:
            others = sorted(set(owners[id(linear.weight)]) - {name})
            raise LoraError(
                f"learner.lora.target_modules: {name} shares its weight with {others[0]} (tied weights); "
                "leave it out"
            )


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors alone, detached (they share storage with the live parameters), named as the model
    names them (`<layer>.lora_A`, `<layer>.lora_B`)."""
    return {
        f"{name}.{part}": getattr(layer, part).detach()
        for name, layer in lora_layers(model).items()
        for part in ADAPTER_NAMES
    }


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the base model with every adapter folded into its weight (fresh tensors there; the
    rest detached views, tied weights still shared): `load_state_dict` of a plain model of the same
    architecture takes it, and so does `save_pretrained(state_dict=...)`."""
    layers = lora_layers(model)
    adapters = {f"{name}.{part}" for name in layers for part in ADAPTER_NAMES}
    state = {k: v.detach() for k, v in model.state_dict().items() if k not in adapters}
    for name, layer in layers.items():
        state[f"{name}.weight"] = layer.merged_weight()
    return state


def served_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """What the samplers get (Learner.named_weights): the parameters under their base names, tied ones once;
    with LoRA the merged weights instead of base and adapter."""
    if not lora_layers(model):
        return dict(model.named_parameters())
    merged = merged_state(model)
    return {name: merged[name] for name, _ in model.named_parameters() if name in merged}


def base_fingerprint(model: nn.Module) -> str:
    """system/lora_sync.py `fingerprint` of the base: the adapters are left out, so a model has the same
    fingerprint before and after `apply_lora`, and after any number of LoRA steps; an HF sampler holding
    the same base in the same dtype computes the same one. A sharded model's is the one kept before sharding
    (learner/lora_sharded.py `keep_base_fingerprint`; the base is frozen, so it holds for the whole run)."""
    kept = getattr(model, KEPT_FINGERPRINT, None)
    return kept if isinstance(kept, str) else fingerprint(model.named_parameters())


def published_weights(model: nn.Module, cfg: Any, full: Callable[[], dict[str, torch.Tensor]]) -> dict:
    """What the learner publishes (Learner._publish): with LoRA the adapter alone (`adapter_weights`; HF
    samplers merge it, vLLM samplers load it as a vLLM LoRA adapter, actors/policy/vllm_lora.py) unless
    `sampler.engine.enable_lora` is false (vLLM samplers then get merged weights); else `full()`."""
    if lora_layers(model) and samplers_load_adapters(cfg):
        return adapter_weights(model, getattr(torch, cfg.weights_dtype))
    return full()


def adapter_weights(model: nn.Module, dtype: torch.dtype) -> NamedWeights:
    """What a LoRA learner publishes to HF samplers (system/lora_sync.py): CPU copies of the adapter tensors
    in `dtype`, with scaling, rank and the base's fingerprint in the header's meta."""
    first = next(iter(lora_layers(model).values()))  # a sharded model's adapter: gathered, on every rank
    tensors = {n: whole(t).to("cpu", dtype, copy=True) for n, t in adapter_state(model).items()}
    return adapter_message(tensors, first.scaling, first.rank, base_fingerprint(model))


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank gathers it, in the same order); a tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def adapter_meta(model: nn.Module) -> dict[str, Any]:
    """What a checkpoint records to refuse a foreign adapter: the base's fingerprint and the adapter's
    shape (rank, alpha, number of layers); dropout too, for the record."""
    layers = list(lora_layers(model).values())
    first = layers[0]
    return {
        "base_fingerprint": base_fingerprint(model),
        "rank": first.rank,
        "alpha": first.alpha,
        "dropout": first.dropout,
        "layers": len(layers),
    }


def check_adapter(model: nn.Module, meta: dict[str, Any], where: str | Path) -> None:
    """Refuses (one line) an adapter recorded by `adapter_meta` that does not fit `model`."""
    live = adapter_meta(model)
    if meta["base_fingerprint"] != live["base_fingerprint"]:
        raise LoraError(
            f"{where}: the LoRA adapter was trained on another base model (fingerprint "
            f"{meta['base_fingerprint']}, this model's is {live['base_fingerprint']}); use the base it "
            "was trained on (the run's model.path)"
        )
    for key in ("rank", "alpha", "layers"):
        if meta[key] != live[key]:
            raise LoraError(
                f"{where}: the LoRA adapter has {key} {meta[key]}, this model's has {live[key]}; "
                "use the run's learner.lora settings"
            )


def load_adapter(
    model: nn.Module, tensors: dict[str, torch.Tensor], meta: dict[str, Any], where: str
) -> None:
    """Copies an adapter (`adapter_state`, with its `adapter_meta`) into a model adapted the same way, after
    `check_adapter`; the base is left as it is."""
    check_adapter(model, meta, where)
    live = adapter_state(model)
    if set(tensors) != set(live):
        odd = sorted(set(tensors) ^ set(live))[0]
        raise LoraError(f"{where}: the LoRA adapter's tensors are not this model's (first apart: {odd})")
    with torch.no_grad():
        for name, value in tensors.items():
            live[name].copy_(value)


def save_with_adapter(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **kwargs: Any,
) -> Path:
    """storage/checkpoint.py `save_checkpoint`; for an adapted model with its adapter (module docstring)."""
    adapter = None
    if lora_layers(model):
        adapter = Adapter(adapter_state(model), merged_state(model), adapter_meta(model))
    return save_checkpoint(run_dir, step, model, optimizer, adapter=adapter, **kwargs)


def restore_with_adapter(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model, optimizer and RNGs from `ckpt`: one rank's, a sharded run's (DCP) or a LoRA run's, each into a
    learner of its own kind only (one line refuses the others)."""
    check_restorable(ckpt, model)
    if ckpt.meta.get("format") == DCP_FORMAT:  # a sharded run's checkpoint, restored in one process
        restore_dcp(ckpt, model, optimizer)
    else:
        ckpt.restore(model, optimizer)


def check_restorable(ckpt: Checkpoint, model: nn.Module) -> None:
    """Refuses in one line, before anything is loaded, a LoRA checkpoint for a full model, a full one for a
    LoRA model, and an adapter of another base, rank, alpha or layer set (`check_adapter`)."""
    kept, adapted = ckpt.meta.get("lora"), bool(lora_layers(model))
    if kept is None and adapted:
        raise LoraError(
            f"{ckpt.path} holds no LoRA adapter (a full run's): resume it with learner.lora.rank = 0"
        )
    if kept is not None and not adapted:
        rank = kept["rank"]
        raise LoraError(f"{ckpt.path} holds a LoRA adapter: resume it with learner.lora.rank = {rank}")
    if kept is not None:
        check_adapter(model, kept, ckpt.path)
