"""`treeopsd export`: a learner checkpoint as a Hugging Face folder.

    treeopsd export RUN_DIR [--step N] [--dtype float32|bfloat16] [--adapter-out DIR] OUT

Reads `RUN_DIR/checkpoints/step_N` (default: the newest that verifies) in either format — one rank's
safetensors (format 1) or the sharded learner's DCP shards (format 2, gathered here in one process, any rank
count) — and writes OUT with `save_pretrained` (config, generation config, model.safetensors) and the
tokenizer, so `AutoModelForCausalLM.from_pretrained(OUT)` loads it. OUT appears whole or not at all (temp
folder, fsync, rename); an existing OUT is refused.

A LoRA run's checkpoint (meta "lora", its adapter in lora.safetensors) gives both: OUT, the merged model as
above, and the adapter as a PEFT-format folder (storage/lora_peft.py: adapter_config.json naming the run's
`model.path` as base_model_name_or_path and the target modules, adapter_model.safetensors), which PEFT and
vLLM's LoRA loader read over the base: OUT/adapter, or `--adapter-out DIR` (written whole or not at all).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory (holds checkpoints/)")
    parser.add_argument("out", help="the HF folder to write (must not exist)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--adapter-out", default=None, help="a LoRA run's adapter, a PEFT folder, here (default OUT/adapter)"
    )


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Any:
    """The checkpoint of `step` (verified), or the newest valid one; CheckpointError when there is none."""
    from storage.checkpoint import CheckpointError, checkpoint_root, load_latest, verify_checkpoint

    if not Path(run_dir).is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist")
    if step is not None:
        return verify_checkpoint(checkpoint_root(run_dir) / f"step_{step:06d}")
    ckpt = load_latest(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{checkpoint_root(run_dir)} holds no valid checkpoint")
    return ckpt


def export_checkpoint(
    ckpt: Any,
    out: str | Path,
    dtype: str = "float32",
    *,
    adapter_out: str | Path | None = None,
    base_model: str | None = None,
) -> Path:
    """Writes `ckpt` as an HF folder at `out` and, for a LoRA run's, its adapter as a PEFT folder at
    `adapter_out` (default `out`/adapter; `base_model` its base_model_name_or_path) (module docstring);
    returns `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from storage.checkpoint import CheckpointError
    from storage.dcp_checkpoint import full_model_tensors
    from storage.durable import publish_directory

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pick a new folder")
    if adapter_out is not None and Path(adapter_out).exists():
        raise FileExistsError(f"{adapter_out} exists; pick a new folder for the adapter")
    adapter = checkpoint_adapter(ckpt)
    config = AutoConfig.from_pretrained(ckpt.path, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(full_model_tensors(ckpt), strict=False)
    state = model.state_dict()
    loaded = {state[k].data_ptr() for k in state if k not in missing}
    untied = [k for k in missing if state[k].data_ptr() not in loaded]  # a tied LM head is not missing
    if unexpected or untied:
        raise CheckpointError(f"{ckpt.path}: weights do not fit: missing {untied}, extra {unexpected}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{uuid.uuid4().hex[:8]}")
    try:
        model.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
        if (ckpt.path / "tokenizer_config.json").exists():
            AutoTokenizer.from_pretrained(ckpt.path, local_files_only=True).save_pretrained(tmp)
        if adapter is not None and adapter_out is not None:
            publish_adapter(Path(adapter_out), adapter, getattr(torch, dtype), base_model)
        elif adapter is not None:
            write_adapter(tmp / "adapter", adapter, getattr(torch, dtype), base_model)
        publish_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def checkpoint_adapter(ckpt: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(adapter tensors by the model's names, meta "lora") of a LoRA run's checkpoint, one rank's
    (lora.safetensors) or a sharded run's (the "lora.*" DCP shards); None for a full run's, and (with a
    warning: the merged model is still exported) for one whose adapter is missing."""
    from storage.checkpoint import DCP_FORMAT, LORA
    from storage.dcp_checkpoint import adapter_tensors

    meta = ckpt.meta.get("lora")
    if meta is None:
        return None
    if ckpt.meta.get("format") != DCP_FORMAT and not (ckpt.path / LORA).is_file():
        log.warning("%s: a LoRA checkpoint without %s: the merged model only", ckpt.path, LORA)
        return None
    return adapter_tensors(ckpt), meta


def write_adapter(folder: Path, adapter: tuple[dict, dict], dtype: Any, base_model: str | None) -> Path:
    """The adapter as a PEFT folder (storage/lora_peft.py), its tensors in `dtype`."""
    from storage.lora_peft import write_peft

    tensors, meta = adapter
    rank = int(meta["rank"])
    return write_peft(
        folder,
        {k: v.to(dtype) for k, v in tensors.items()},
        scaling=float(meta["alpha"]) / rank,
        rank=rank,
        base_model=base_model,
        fingerprint=meta.get("base_fingerprint"),
    )


def publish_adapter(out: Path, adapter: tuple[dict, dict], dtype: Any, base_model: str | None) -> None:
    """`write_adapter` to a temp folder beside `out`, then one rename (`out` appears whole or not at all)."""
    from storage.durable import publish_directory

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{uuid.uuid4().hex[:8]}")
    try:
        publish_directory(write_adapter(tmp, adapter, dtype, base_model), out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def run_base_model(run_dir: str | Path) -> str | None:
    """The run's `model.path` (RUN_DIR/config.yaml), the adapter's base; None when it cannot be read."""
    import yaml

    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
        return str(cfg["model"]["path"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None


def hf_folder(step_dir: str | Path) -> str:
    """A folder `from_pretrained` loads for this checkpoint: itself (format 1), else an export beside the
    run's checkpoints (`RUN_DIR/exports/step_k`, made once)."""
    from storage.checkpoint import FORMAT, verify_checkpoint

    ckpt = verify_checkpoint(Path(step_dir), hashes=False)
    if ckpt.meta.get("format") == FORMAT:
        return str(ckpt.path)
    out = ckpt.path.parent.parent / "exports" / ckpt.path.name
    return str(out if out.exists() else export_checkpoint(ckpt, out))


def run(args: argparse.Namespace) -> int:
    from storage.checkpoint import CheckpointError

    try:
        ckpt = find_checkpoint(args.run_dir, args.step)
        base = run_base_model(args.run_dir)
        out = export_checkpoint(ckpt, args.out, args.dtype, adapter_out=args.adapter_out, base_model=base)
    except (CheckpointError, FileExistsError, OSError) as e:
        print(f"treeopsd export: {e}", file=sys.stderr)
        return 2
    print(f"exported {ckpt.path} (step {ckpt.step}, format {ckpt.meta.get('format')}) to {out}")
    if ckpt.meta.get("lora") is not None:
        print(f"LoRA adapter (PEFT format, base {base}) in {args.adapter_out or Path(out) / 'adapter'}")
    return 0
