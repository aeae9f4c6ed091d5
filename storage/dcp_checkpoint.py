"""Sharded checkpoints of the sharded learner (learner.ranks > 1): torch DCP, resharded on load, no pickle.

Layout (format 2; format 1 is storage/checkpoint.py's, and both share its `latest` pointer, its pruning and
`load_latest`, which skips a broken checkpoint for the previous one)::

    run_dir/checkpoints/step_000007/
        dcp/shard-0000<r+1>-model-00001-of-00001.safetensors   rank r's shards of the model ("model.<fqn>")
                                                               and of AdamW ("optim.state.<fqn>.<name>");
                                                               a LoRA run's: the merged weights as "model.*"
                                                               and its adapter as "lora.<layer>.lora_A|B"
        config.json, generation_config.json, tokenizer files    (rank 0) what `treeopsd export` needs
        rng.safetensors                                        (rank 0) torch RNG states
        meta.json                                              format 2, step, version, extra (the store
            watermark), ranks, the optimizer's param groups and other non-tensor state (JSON), tied-weight
            aliases, python/numpy RNG states, size + sha256 of every other file; written last; a LoRA
            run's "lora": the base's fingerprint, rank, alpha (learner/lora.py `adapter_meta`)

A LoRA run's checkpoint (learner/lora_sharded.py builds its `Adapter`) keeps what a one-rank LoRA checkpoint
keeps: "model.*" are the merged weights W + scale·B·A under the base's names (what export and
`full_model_tensors` read), "lora.*" the adapter; a resume loads the adapter and AdamW's moments alone, into
the frozen base it was trained on (its fingerprint is checked first, learner/lora.py).

The shards are written by torch DCP through `HuggingFaceStorageWriter(save_distributed=True)`: safetensors
files whose header carries each shard's offsets as JSON, so `HuggingFaceStorageReader` rebuilds the global
layout from the headers alone and loads into any rank count (DCP's default writer would pickle its
`.metadata` file; here nothing is pickled). Non-tensor values never reach DCP (it would torch.save them).

Atomicity: every rank writes into `checkpoints/.tmp-step_k-dcp` (rank 0 clears it first; a barrier between),
each shard file is fsynced by its writer, then rank 0 writes the rest and `publish_directory` renames the
directory into place (storage/durable.py) and points `latest` at it. Multi-node runs need run_dir on a file
system every rank sees.
"""

from __future__ import annotations

import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from storage.checkpoint import (
    DCP_FORMAT,
    LORA,
    Adapter,
    Checkpoint,
    CheckpointError,
    _from_json,
    _point_latest,
    _prune,
    _rng_state,
    _set_rng_state,
    _sha256,
    _write_json,
    checkpoint_root,
)
from storage.durable import fsync_dir, publish_directory
from system.lora_sync import ADAPTER_NAMES

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
ADAPTER_PREFIX = "lora."  # a LoRA run's adapter tensors in the DCP shards ("lora.<layer>.lora_A")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _load(state: dict[str, torch.Tensor], folder: Path) -> None:
    """dcp.load from a shard folder: collectively in a process group, else in this process alone."""
    reader = HuggingFaceStorageReader(str(folder))
    if dist.is_initialized():
        dcp.load(state, storage_reader=reader)
        return
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)


def _model_tensors(model: nn.Module) -> tuple[dict[str, Any], dict[str, str]]:
    """The model's state dict under "model.<fqn>" (DTensor shards or plain tensors), each storage once:
    tied weights (an LM head sharing the embeddings) become aliases {fqn: fqn it shares}."""
    return _unique(get_model_state_dict(model))


def _adapter_tensors(model: nn.Module) -> dict[str, Any]:
    """A LoRA model's adapter tensors (DTensor shards or plain tensors) under "lora.<fqn>"."""
    state: dict[str, Any] = get_model_state_dict(model)
    return {ADAPTER_PREFIX + k: v for k, v in state.items() if k.rsplit(".", 1)[-1] in ADAPTER_NAMES}


def _unique(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """`state` under "model.<fqn>", each storage once; the others as aliases (see `_model_tensors`)."""
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}  # (storage, offset, shape) → fqn
    for fqn, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if local.numel() and key in seen:
            aliases[fqn] = seen[key]
            continue
        seen[key] = fqn
        tensors[f"model.{fqn}"] = value
    return tensors, aliases


def _optimizer_parts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """AdamW's flattened state dict split into tensors (for DCP) and everything else (for JSON)."""
    flat = get_optimizer_state_dict(model, optimizer, options=FLAT)
    tensors = {f"optim.{k}": v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    return tensors, values


# ---- save -----------------------------------------------------------------------------------------------
def save_dcp_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    version: int,
    extra: dict,
    tokenizer: Any = None,
    keep: int = 3,
    adapter: Adapter | None = None,
) -> Path:
    """Called by every rank of the process group; returns `checkpoints/step_{step:06d}` (see above). With
    `adapter` (a LoRA run's, its tensors DTensor shards): the merged weights and the adapter."""
    root = checkpoint_root(run_dir)
    tmp, final = root / f".tmp-step_{step:06d}-dcp", root / f"step_{step:06d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that crashed
        tmp.mkdir()
    _barrier()
    if adapter is None:
        tensors, aliases = _model_tensors(model)
    else:
        tensors, aliases = _unique(adapter.merged)
        tensors.update({ADAPTER_PREFIX + k: v for k, v in adapter.tensors.items()})
    opt_tensors, opt_values = _optimizer_parts(model, optimizer)
    writer = HuggingFaceStorageWriter(str(tmp / "dcp"), save_distributed=True)
    with warnings.catch_warnings():
        if not dist.is_initialized():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
        dcp.save({**tensors, **opt_tensors}, storage_writer=writer, no_dist=not dist.is_initialized())
    _barrier()  # every shard written and fsynced by its writer
    if _rank() == 0:
        fsync_dir(tmp / "dcp")
        meta = {"format": DCP_FORMAT, "step": int(step), "version": int(version), "extra": extra or {}}
        meta.update(ranks=dist.get_world_size() if dist.is_initialized() else 1, aliases=aliases)
        meta.update(optimizer=True, optimizer_values=[[k, v] for k, v in opt_values.items()])
        if adapter is not None:
            meta["lora"] = adapter.meta
        _publish(tmp, final, model, tokenizer, meta)
        _point_latest(root, final.name)
        _prune(root, keep)
    _barrier()  # nobody moves on (or saves again) before the checkpoint is live
    return final


def _publish(tmp: Path, final: Path, model: nn.Module, tokenizer: Any, meta: dict) -> None:
    """Rank 0: config, tokenizer, RNG, meta.json (with every file's size and hash), then the one rename."""
    hf: Any = model  # an HF PreTrainedModel
    try:
        hf.config.save_pretrained(tmp)
        if getattr(hf, "generation_config", None) is not None:
            hf.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        rng_tensors, rng_rest = _rng_state()
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        meta["rng"] = rng_rest
        meta["files"] = {
            str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        _write_json(tmp / "meta.json", meta)
        old = None
        if final.exists():  # the same step saved again (after a resume): swap, then delete the old one
            old = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
            final.rename(old)
        publish_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- load -----------------------------------------------------------------------------------------------
def restore_dcp(
    ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, rng: bool = True
) -> None:
    """A format-2 checkpoint into `model` (sharded with FSDP2 over any rank count, or a plain module in one
    process) and `optimizer`; DCP reads each rank's part of every tensor from whichever shards hold it. A
    LoRA run's: the adapter alone (the base stays the model's own; learner/lora.py checked it first)."""
    if ckpt.meta.get("lora") is not None:
        tensors, prefix = _adapter_tensors(model), ADAPTER_PREFIX
    else:
        tensors, prefix = _model_tensors(model)[0], "model."
    opt_tensors, _ = _optimizer_parts(model, optimizer) if optimizer is not None else ({}, {})
    _load({**tensors, **opt_tensors}, ckpt.path / "dcp")
    full = {k.removeprefix(prefix): v for k, v in tensors.items()}
    if prefix == "model.":
        full.update({alias: full[target] for alias, target in ckpt.meta.get("aliases", {}).items()})
    set_model_state_dict(model, full, options=StateDictOptions(strict=prefix == "model."))
    if optimizer is not None:
        flat = {k.removeprefix("optim."): v for k, v in opt_tensors.items()}
        flat.update({k: _from_json(v) for k, v in ckpt.meta["optimizer_values"]})
        set_optimizer_state_dict(model, optimizer, flat, options=FLAT)
    if rng:
        _set_rng_state(load_file(str(ckpt.path / "rng.safetensors")), _from_json(ckpt.meta["rng"]))


def restore_into(
    ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, rng: bool = True
) -> None:
    """Either format into a sharded (or plain) model: format 2 through DCP; format 1 (one rank's
    safetensors) as full tensors that every rank cuts its shards from (a LoRA run's: its adapter alone,
    lora.safetensors; its model.safetensors holds merged weights)."""
    if ckpt.meta.get("format") == DCP_FORMAT:
        restore_dcp(ckpt, model, optimizer, rng)
        return
    lora = ckpt.meta.get("lora") is not None
    full: dict[str, Any] = adapter_tensors(ckpt) if lora else full_model_tensors(ckpt)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
    if optimizer is not None:
        state = ckpt.optimizer_state()
        if state is None:
            raise CheckpointError(f"{ckpt.path} holds no optimizer state")
        set_optimizer_state_dict(
            model, optimizer, _by_name(model, state), options=StateDictOptions(full_state_dict=True)
        )
    if rng:
        _set_rng_state(load_file(str(ckpt.path / "rng.safetensors")), _from_json(ckpt.meta["rng"]))


def _by_name(model: nn.Module, state: dict) -> dict:
    """A plain `optimizer.state_dict()` (the trained parameters numbered in `model.parameters()` order, one
    group: all of them, or a LoRA model's adapters) keyed by parameter names instead, as the distributed
    state-dict API takes it."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in state["param_groups"]]
    return {"state": {names[int(i)]: v for i, v in state["state"].items()}, "param_groups": groups}


def full_model_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The model's full tensors (state-dict names, fp32 as trained), read in one process from either
    format; tied aliases included."""
    if ckpt.meta.get("format") != DCP_FORMAT:
        out: dict[str, torch.Tensor] = {}
        for f in sorted(ckpt.path.glob("model*.safetensors")):
            out.update(load_file(str(f)))
        return out
    out = _read_full(ckpt, "model.")
    out.update({alias: out[t] for alias, t in ckpt.meta.get("aliases", {}).items()})
    return out


def adapter_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """A LoRA run's adapter (`<layer>.lora_A`/`.lora_B`, fp32 as trained), read in one process from either
    format: lora.safetensors (format 1) or the "lora.*" DCP shards (format 2); {} for a full run's."""
    if ckpt.meta.get("lora") is None:
        return {}
    if ckpt.meta.get("format") != DCP_FORMAT:
        return load_file(str(ckpt.path / LORA))
    return _read_full(ckpt, ADAPTER_PREFIX)


def _read_full(ckpt: Checkpoint, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` of a format-2 checkpoint, whole, in this process (prefix removed)."""
    layout = HuggingFaceStorageReader(str(ckpt.path / "dcp")).read_metadata().state_dict_metadata
    target = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)  # type: ignore[union-attr]
        for k, m in layout.items()
        if k.startswith(prefix)
    }
    _load(target, ckpt.path / "dcp")
    return {k.removeprefix(prefix): v for k, v in target.items()}
