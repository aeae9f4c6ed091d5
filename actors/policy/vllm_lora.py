"""A vLLM sampler's side of adapter-only weight sync (system/lora_sync.py): each received LoRA adapter
becomes a vLLM LoRA adapter of its own, and every turn runs with the adapter the sampler had when the turn
started.

vLLM 0.32's CPU backend serves LoRA (vllm/platforms/cpu.py: `PunicaWrapperCPU`, its torch ops; with a LoRA
config it switches torch.compile off, so a LoRA engine also starts faster there). The engine is built with
`lora_engine_args(rank)`: `enable_lora`, `max_lora_rank` the smallest rank vLLM allows at or above the
learner's, `max_loras` 2 (a batch may mix the adapter being drained and the new one) and `max_cpu_loras` 3.

How an adapter gets in: vLLM loads adapters from a PEFT folder only (`LoRARequest.lora_path`; no tensor
API in 0.32), so `stage` (in a worker thread, while turns still run) checks the adapter and writes it as
a PEFT folder in tmpfs (storage/lora_peft.py; an adapter is small: 45 KB for the tiny test model, a few MB
at rank 8 on a 1B model); `load` (between turns, the weight gate's pause) asks the engine to `add_lora`,
which returns once every worker has loaded it: only then is the version the sampler's (`version` set, the
weight gate counts it applied). A refused adapter (another base, another layer set, a rank above the
engine's) raises one line in `stage`, before the engine is touched.

Names: `v{version}.{id}` with `id` this sampler's counter (never reused), because vLLM keys its prefix
cache by the adapter's name: a name reused across versions (or a version published again after a
rewind) would serve KV computed by other weights. Release: each request holds the adapter it started with
(`acquire` / `done`); an adapter that is no longer the current one is removed from the engine
(`remove_lora`) and its folder deleted when its last request ends, at once if it has none.

Base fingerprint: the learner hashes its float32 base (learner/device.py keeps float32 weights); this side
reads the same sampled values from the checkpoint's safetensors files through a private mapping (only the
sampled pages are read), casts them to float32 and hashes them alike (`fingerprint_of`). Whole weights
loaded later replace their names' values (`rebase`).
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.policy.vllm_weights import local_model_dir, tmpfs_dir
from storage.lora_peft import remove_peft, write_peft
from system.lora_sync import AdapterMismatch, adapter_layers, fingerprint_of, sampled

logger = logging.getLogger(__name__)

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def lora_engine_args(rank: int) -> dict[str, Any]:
    """The engine arguments that let it load adapters of `rank` (nothing for rank 0)."""
    if rank <= 0:
        return {}
    fits = [r for r in VLLM_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"learner.lora.rank {rank} is above vLLM's largest max_lora_rank {VLLM_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 2, "max_cpu_loras": 3}


def checkpoint_samples(model_path: str, tied: bool, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """name -> (shape, sampled values cast to `dtype`) of every tensor in the checkpoint's safetensors files
    (a tied LM head left out, as `named_parameters` leaves it out), read through a private mapping."""
    folder = local_model_dir(model_path)
    if folder is None:
        raise AdapterMismatch(f"LoRA adapter refused: no local checkpoint at {model_path} to fingerprint")
    parts: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        n = int.from_bytes(buf[:8], "little")
        header = json.loads(buf[8 : 8 + n])
        for name, spec in header.items():
            if name == "__metadata__" or (tied and name == "lm_head.weight"):
                continue
            dt = _ST_DTYPES.get(spec["dtype"])
            begin, end = spec["data_offsets"]
            if dt is None:
                raise AdapterMismatch(f"LoRA adapter refused: {file.name}: {name} has dtype {spec['dtype']}")
            flat = torch.frombuffer(buf, dtype=dt, count=(end - begin) // dt.itemsize, offset=8 + n + begin)
            parts[name] = (tuple(spec["shape"]), sampled(flat).to(dtype).clone())
    return parts


@dataclass
class StagedAdapter:
    """An adapter checked and written as a PEFT folder, ready for `VLLMAdapters.load`."""

    lora_id: int
    folder: Path


class VLLMAdapters:
    """The adapters a VLLMBackend holds (module docstring). `max_rank` 0: its engine has no LoRA."""

    def __init__(self, model_path: str, shapes: Mapping[str, tuple[int, ...]], tied: bool, max_rank: int):
        self.model_path, self.shapes, self.tied, self.max_rank = model_path, shapes, tied, max_rank
        self.current: Any = None  # the LoRARequest new requests get (None: the base weights)
        self.loaded: dict[int, tuple[Any, Path]] = {}  # lora id -> (its LoRARequest, its folder)
        self.in_use: Counter[int] = Counter()  # lora id -> requests running with it
        self._ids = itertools.count(1)
        self._parts: dict[str, Any] | None = None
        self.fingerprint: str | None = None
        self._root: Path | None = None

    def base_fingerprint(self) -> str:
        if self.fingerprint is None:
            if self._parts is None:
                self._parts = checkpoint_samples(self.model_path, self.tied)
            self.fingerprint = fingerprint_of(self._parts)
        return self.fingerprint

    def rebase(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Whole weights were loaded: they are the base of later adapters, and vLLM's `reload_weights` has
        removed every adapter from the workers (`reset_lora_state`): none is current or kept now."""
        if self.max_rank == 0:
            return
        if self._parts is None:
            self._parts = checkpoint_samples(self.model_path, self.tied)
        for name, t in tensors.items():
            self._parts[name] = (tuple(t.shape), sampled(t).to(torch.float32).clone())
        self.fingerprint, self.current = None, None
        for lora_id in [i for i in self.loaded if not self.in_use[i]]:
            remove_peft(self.loaded.pop(lora_id)[1])

    def stage(self, adapter: Mapping[str, Any]) -> StagedAdapter:
        """Checks `adapter` (a NamedWeights with the adapter meta) and writes its PEFT folder; one line
        refuses one that does not fit, before the engine is touched."""
        meta = getattr(adapter, "meta", {})
        if self.max_rank == 0:
            raise AdapterMismatch(
                "LoRA adapter refused: this vLLM sampler's engine was started without LoRA "
                "(build it with lora_rank = learner.lora.rank)"
            )
        if int(meta["rank"]) > self.max_rank:
            raise AdapterMismatch(
                f"LoRA adapter refused: rank {meta['rank']} is above the engine's max_lora_rank "
                f"{self.max_rank}"
            )
        mine = self.base_fingerprint()
        if meta.get("base_fingerprint") != mine:
            raise AdapterMismatch(
                f"LoRA adapter refused: it was trained on another base model (fingerprint "
                f"{meta.get('base_fingerprint')}, this sampler's is {mine}); start the samplers from the "
                "learner's model.path"
            )
        self._check_shapes(adapter_layers(adapter))
        lora_id = next(self._ids)
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="treeopsd-lora-", dir=tmpfs_dir()))
        scaling, rank = float(meta["scaling"]), int(meta["rank"])
        folder = write_peft(self._root / f"a{lora_id}", adapter, scaling=scaling, rank=rank, fingerprint=mine)
        return StagedAdapter(lora_id, folder)

    def _check_shapes(self, layers: dict[str, tuple[Any, Any]]) -> None:
        for layer, (a, b) in layers.items():
            w = self.shapes.get(f"{layer}.weight")
            a_shape, b_shape = tuple(torch.as_tensor(a).shape), tuple(torch.as_tensor(b).shape)
            if w is None or len(w) != 2:
                raise AdapterMismatch(f"LoRA adapter refused: this model has no Linear weight {layer}.weight")
            if len(a_shape) != 2 or a_shape[1] != w[1] or b_shape != (w[0], a_shape[0]):
                raise AdapterMismatch(
                    f"LoRA adapter refused: {layer} has A {a_shape} and B {b_shape}, its weight is {w} "
                    f"(want A [r, {w[1]}] and B [{w[0]}, r])"
                )

    async def load(self, engine: Any, staged: StagedAdapter, version: int) -> None:
        """Adds the staged adapter to every worker (`engine`: the AsyncLLM) and makes it current."""
        from vllm.lora.request import LoRARequest

        name = f"v{version}.{staged.lora_id}"  # unique: vLLM's prefix cache is keyed by it
        req = LoRARequest(name, staged.lora_id, str(staged.folder))
        try:
            if not await engine.add_lora(req):
                raise RuntimeError(f"vLLM did not load LoRA adapter {name} (version {version})")
        except BaseException:
            remove_peft(staged.folder)
            raise
        self.loaded[req.lora_int_id] = (req, staged.folder)
        old, self.current = self.current, req
        if old is not None and not self.in_use[old.lora_int_id]:
            await self._remove(engine, old.lora_int_id)

    def acquire(self) -> Any:
        """The adapter a request starting now runs with (None: the base); `done` when it ends."""
        req = self.current
        if req is not None:
            self.in_use[req.lora_int_id] += 1
        return req

    async def done(self, engine: Any, req: Any) -> None:
        if req is None:
            return
        self.in_use[req.lora_int_id] -= 1
        if not self.in_use[req.lora_int_id] and req is not self.current:
            await self._remove(engine, req.lora_int_id)

    async def _remove(self, engine: Any, lora_id: int) -> None:
        self.in_use.pop(lora_id, None)
        req, folder = self.loaded.pop(lora_id, (None, None))
        if req is not None and not await engine.remove_lora(lora_id):
            logger.warning("vLLM did not remove LoRA adapter %s", req.lora_name)
        if folder is not None:
            remove_peft(folder)

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
