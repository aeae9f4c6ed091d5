"""`treeopsd export`: a learner checkpoint as a Hugging Face folder.

    treeopsd export RUN_DIR [--step N] [--dtype float32|bfloat16] OUT

Reads `RUN_DIR/checkpoints/step_N` (default: the newest that verifies) in either format — one rank's
safetensors (format 1) or the sharded learner's DCP shards (format 2, gathered here in one process, any rank
count) — and writes OUT with `save_pretrained` (config, generation config, model.safetensors) and the
tokenizer, so `AutoModelForCausalLM.from_pretrained(OUT)` loads it. OUT appears whole or not at all (temp
folder, fsync, rename); an existing OUT is refused.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory (holds checkpoints/)")
    parser.add_argument("out", help="the HF folder to write (must not exist)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")


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


def export_checkpoint(ckpt: Any, out: str | Path, dtype: str = "float32") -> Path:
    """Writes `ckpt` as an HF folder at `out` (module docstring); returns `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from storage.checkpoint import CheckpointError
    from storage.dcp_checkpoint import full_model_tensors
    from storage.durable import publish_directory

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pick a new folder")
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
        publish_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


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
        out = export_checkpoint(ckpt, args.out, args.dtype)
    except (CheckpointError, FileExistsError, OSError) as e:
        print(f"treeopsd export: {e}", file=sys.stderr)
        return 2
    print(f"exported {ckpt.path} (step {ckpt.step}, format {ckpt.meta.get('format')}) to {out}")
    return 0
