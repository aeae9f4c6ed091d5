"""A version as `WeightSubscriber.poll` returns it: name -> array, and, when the arrays are views of a sealed
memfd the publisher wrote on this host, that memfd held open by this process (`ReceivedWeights.memfd`).

Why hold it: a vLLM sampler's workers can then map the very bytes the subscriber mapped and verified
(through /proc/<this pid>/fd/<n>), so a received version reaches the engine with no copy in the sampler
(actors/policy/vllm_backend.py). The publisher may retire its own descriptor at any time (a newer version
replaces it); ours keeps the memfd alive until the version is dropped. Only a sealed memfd is offered: the
kernel forbids writes and resizes to it, so every later reader sees the bytes that were checked.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import weakref
from collections.abc import Iterable
from typing import Any

from system.weight_codec import NamedWeights, TensorSpec

_MADV_POPULATE_READ = 22  # Linux >= 5.14: map every page now, without breaking copy-on-write
_SEALS = sum(getattr(fcntl, f"F_SEAL_{name}", 0) for name in ("WRITE", "SHRINK", "GROW")) or -1


def is_sealed(fd: int) -> bool:
    """Whether the kernel refuses every write and resize of `fd`'s file (memfd seals), for every process."""
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if hasattr(fcntl, "F_GET_SEALS") else 0
    return bool(seals & _SEALS == _SEALS)


def prefault(buf: mmap.mmap) -> None:
    """Map every page of a read mapping in one call (a private mapping stays shared until written)."""
    with contextlib.suppress(OSError, ValueError):  # older kernels: the pages fault in one by one
        buf.madvise(_MADV_POPULATE_READ)


class SealedMemfd:
    """A sealed payload memfd, open in this process until `close` (or until nothing refers to it)."""

    def __init__(self, fd: int, size: int, specs: Iterable[TensorSpec]) -> None:
        st = os.fstat(fd)
        self.fd, self.size, self.dev, self.ino = fd, size, st.st_dev, st.st_ino
        self.specs = {t.name: t for t in specs}
        self._close = weakref.finalize(self, os.close, fd)

    def describe(self, names: Iterable[str]) -> dict[str, Any]:
        """What `WeightLoaderExtension.treeopsd_load_shared` maps: the named tensors of this payload (each
        name must be one of its tensors), at their offsets, in the dtype they were broadcast in."""
        if not self._close.alive:
            raise ValueError("the weight memfd is closed")
        layout = []
        for name in names:
            t = self.specs[name]
            layout.append([name, t.dtype, list(t.shape), t.offset, t.nbytes])
        path = f"/proc/{os.getpid()}/fd/{self.fd}"
        return {
            "path": path,
            "dev": self.dev,
            "ino": self.ino,
            "size": self.size,
            "sealed": True,
            "tensors": layout,
        }

    def close(self) -> None:
        self._close()


class ReceivedWeights(NamedWeights):
    """name -> array (numpy; torch for bfloat16), views of one buffer; `meta`: the header's (a LoRA adapter's:
    system/lora_sync.py); `memfd`: see the module docstring."""

    memfd: SealedMemfd | None = None
