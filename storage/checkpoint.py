"""Atomic learner checkpoints: model, optimizer, step, version, RNG states and an opaque `extra` dict.

Layout::

    run_dir/checkpoints/
        latest                      "step_000007\\n", replaced atomically after each save (for tools/humans)
        step_000007/
            config.json, model.safetensors, ...   save_pretrained: AutoModelForCausalLM.from_pretrained(dir)
            tokenizer files                       when a tokenizer is given
            optimizer.safetensors                 every tensor of optimizer.state_dict()["state"]
            optimizer.json                        param_groups and the non-tensor per-parameter state
            lora.safetensors                      a LoRA run's adapter (model.safetensors then holds the
                                                  merged weights: base + B·A under the base's names)
            rng.safetensors                       torch CPU (and CUDA) generator states (uint8 tensors)
            meta.json                             step, version, extra, python/numpy RNG states, and the
                                                  size + sha256 of every other file (written last)

No pickle anywhere (no `torch.save`): these files are read by other processes (the resumed learner, tools,
vLLM), and unpickling runs arbitrary code. Tensors go to safetensors, everything else to JSON.

Atomicity (storage/durable.py): everything is written into `checkpoints/.tmp-...`, then `publish_directory`
fsyncs each file and directory, renames it to `step_k` (atomic on POSIX) and fsyncs the parent; only then is
`latest` replaced (`write_atomic`). A crash leaves either the old state or a complete new directory.
Single writer per run_dir (the learner). `load_latest` walks the step directories newest first (it does
not need the `latest` pointer, so a crash between the rename and the pointer update loses nothing) and
skips, with a warning, any that fails verification — missing meta.json, a missing/short/changed file — so
a torn or corrupted checkpoint falls back to the previous one. `keep` bounds how many complete checkpoints
stay on disk (≥ 2 keeps a fallback).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from storage.durable import publish_directory, write_atomic

FORMAT = 1
DCP_FORMAT = 2  # sharded learner: torch DCP shards in safetensors (storage/dcp_checkpoint.py)
STEP_RE = re.compile(r"^step_(\d{6,})$")
LORA = "lora.safetensors"  # not peft's adapter_model.safetensors: these names are the model's own


class CheckpointError(RuntimeError):
    """A checkpoint directory that is incomplete or corrupted."""


@dataclass(frozen=True)
class Adapter:
    """A LoRA run's part of a checkpoint (learner/lora.py builds it). The merged weights go where a full
    run's weights go, so `from_pretrained`, `treeopsd export` and evaluation read a LoRA checkpoint as they
    read any other; a resume loads the adapter alone, exactly, into the frozen base it was trained on."""

    tensors: dict[str, torch.Tensor]  # the trainable tensors (lora.safetensors), by their module names
    merged: dict[str, torch.Tensor]  # base + adapter in the base model's names (model.safetensors)
    meta: dict  # what a resume checks first: the base's fingerprint, rank, alpha (meta.json "lora")


# ---- JSON for optimizer/RNG state (tuples survive the round trip) -----------------------------------------
def _to_json(x: Any) -> Any:
    if isinstance(x, tuple):
        return {"__tuple__": [_to_json(v) for v in x]}
    if isinstance(x, list):
        return [_to_json(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _to_json(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, bool | int | float | str):
        return x
    raise TypeError(f"cannot store {type(x).__name__} in a checkpoint's JSON")


def _from_json(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__tuple__"}:
            return tuple(_from_json(v) for v in x["__tuple__"])
        return {k: _from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    return x


# ---- optimizer and RNG state ----------------------------------------------------------------------------
def _split_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, values = {}, {}
    for pid, entry in state["state"].items():
        for name, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{pid}.{name}"] = v.detach().cpu().contiguous().clone()
            else:
                values.setdefault(str(pid), {})[name] = v
    return tensors, {"param_groups": state["param_groups"], "values": values}


def _join_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, t in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = t
    for pid, entry in meta["values"].items():
        state.setdefault(int(pid), {}).update(entry)
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda.{i}"] = s
    np_state = np.random.get_state(legacy=False)
    return tensors, {"python": random.getstate(), "numpy": np_state}


def _set_rng_state(tensors: dict[str, torch.Tensor], states: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted((k for k in tensors if k.startswith("torch_cuda.")), key=lambda k: int(k.split(".")[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = dict(states["numpy"])
    np_state["state"] = dict(np_state["state"], key=np.asarray(np_state["state"]["key"], dtype=np.uint32))
    np.random.set_state(np_state)


# ---- files ----------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(_to_json(data), indent=1, sort_keys=True))


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_bytes(path: Path) -> int:
    """Bytes on disk of one checkpoint directory (the `learner/checkpoint_mb` metric)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# ---- save -----------------------------------------------------------------------------------------------
def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    version: int = 0,
    extra: dict | None = None,
    tokenizer: Any = None,
    keep: int = 3,
    adapter: Adapter | None = None,
) -> Path:
    """Writes `run_dir/checkpoints/step_{step:06d}` atomically, points `latest` at it, prunes old ones."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step_{step:06d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=adapter.merged if adapter else None)
        if adapter is not None:
            save_file({k: v.detach().cpu().contiguous() for k, v in adapter.tensors.items()}, str(tmp / LORA))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if optimizer is not None:
            tensors, rest = _split_optimizer(optimizer.state_dict())
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            _write_json(tmp / "optimizer.json", rest)
        rng_tensors, rng_rest = _rng_state()
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        files = {
            str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        meta = {"format": FORMAT, "step": int(step), "version": int(version), "extra": extra or {}}
        meta.update(rng=rng_rest, files=files, optimizer=optimizer is not None)
        if adapter is not None:
            meta["lora"] = adapter.meta
        _write_json(tmp / "meta.json", meta)
        final = root / f"step_{step:06d}"
        old = None
        if final.exists():  # the same step saved again (e.g. after a resume): swap, then delete the old one
            old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
        publish_directory(tmp, final)  # every file fsynced, one rename, the parent fsynced
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _point_latest(root, final.name)
    _prune(root, keep)
    return final


def _point_latest(root: Path, name: str) -> None:
    write_atomic(root / "latest", (name + "\n").encode(), unique=True)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking step directories, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def _prune(root: Path, keep: int) -> None:
    for _, path in _step_dirs(root)[max(keep, 1) :]:
        shutil.rmtree(path, ignore_errors=True)
    for pattern in (".tmp-step_*", ".old-step_*", ".latest-*"):  # debris of a writer that crashed mid-save
        for path in root.glob(pattern):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


# ---- load -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint directory; `restore` puts its state back into live objects."""

    path: Path
    step: int
    version: int
    extra: dict
    meta: dict

    def optimizer_state(self) -> dict | None:
        if not self.meta.get("optimizer"):
            return None
        rest = _from_json(json.loads((self.path / "optimizer.json").read_text()))
        return _join_optimizer(load_file(str(self.path / "optimizer.safetensors")), rest)

    def restore(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, rng: bool = True
    ) -> None:
        """Loads weights into `model` (in place), the optimizer state, and (rng=True) the global RNGs."""
        if self.meta.get("format") == DCP_FORMAT:  # sharded (torch DCP) checkpoint of learner.ranks > 1
            raise CheckpointError(f"{self.path} is sharded (DCP): storage/dcp_checkpoint.py restores it")
        if self.meta.get("lora") is not None:  # the adapter: model.safetensors holds the merged weights
            self._load_adapter(model)
        else:
            load_model_weights(model, self.path)
        if optimizer is not None:
            state = self.optimizer_state()
            if state is None:
                raise CheckpointError(f"{self.path} holds no optimizer state")
            optimizer.load_state_dict(state)
        if rng:
            _set_rng_state(load_file(str(self.path / "rng.safetensors")), _from_json(self.meta["rng"]))

    def _load_adapter(self, model: torch.nn.Module) -> None:
        """The adapter tensors into the model's own (learner/lora.py checks the base and the shapes first)."""
        tensors = load_file(str(self.path / LORA))
        if unknown := sorted(set(tensors) - set(model.state_dict())):
            raise CheckpointError(f"{self.path}: the model has no LoRA tensor {unknown[0]} (learner.lora)")
        model.load_state_dict(tensors, strict=False)


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Copies the weights of a save_pretrained folder into `model` in place.

    Fast path: the safetensors keys are the module's state-dict keys (tied weights may be absent). When they
    are not (transformers 5 renames/fuses some architectures' weights on save, e.g. MoE experts), the folder
    is loaded through `from_pretrained` and its state dict copied over (needs memory for a second model).
    """
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no model*.safetensors")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    live = model.state_dict()
    if set(weights) <= set(live):
        loaded_ptrs = {live[k].data_ptr() for k in weights}
        if all(live[k].data_ptr() in loaded_ptrs for k in set(live) - set(weights)):  # only tied ones absent
            model.load_state_dict(weights, strict=False)
            return
    fresh = type(model).from_pretrained(folder, local_files_only=True, dtype=next(model.parameters()).dtype)
    model.load_state_dict(fresh.state_dict())


def verify_checkpoint(path: Path, hashes: bool = True) -> Checkpoint:
    """Checks meta.json and every file it lists (size, and sha256 when `hashes`); raises CheckpointError."""
    try:
        meta = _from_json(json.loads((path / "meta.json").read_text()))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable meta.json ({e})") from None
    if meta.get("format") not in (FORMAT, DCP_FORMAT):
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT} or {DCP_FORMAT}")
    for rel, info in meta["files"].items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != info["size"]:
            raise CheckpointError(f"{path}: {rel} is missing or has the wrong size")
        if hashes and _sha256(f) != info["sha256"]:
            raise CheckpointError(f"{path}: {rel} does not match its sha256")
    return Checkpoint(path, int(meta["step"]), int(meta["version"]), dict(meta["extra"]), meta)


def load_latest(run_dir: str | Path, hashes: bool = True) -> Checkpoint | None:
    """The newest checkpoint that verifies, or None; broken ones are skipped with a warning.

    `hashes=False` checks sizes only (faster for multi-GB models; misses same-size corruption).
    """
    for _, path in _step_dirs(checkpoint_root(run_dir)):
        try:
            return verify_checkpoint(path, hashes)
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
    return None


def checkpointed_metrics(ckpt: Checkpoint) -> dict[str, float] | None:
    """The metrics of the step a checkpoint holds (None in a checkpoint written before a step, or by an
    older version)."""
    kept = ckpt.extra.get("step_metrics")
    return {str(k): float(v) for k, v in kept.items()} if isinstance(kept, dict) else None
