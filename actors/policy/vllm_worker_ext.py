"""vLLM worker extension: in-place weight reload from the sampler's memfd, or from a safetensors file.

vLLM mixes this class into its worker class when the engine is built with
`worker_extension_cls="actors.policy.vllm_worker_ext.WeightLoaderExtension"`; the backend then calls
`collective_rpc("treeopsd_load_shared", args=(source,))` (or `treeopsd_load_weights` with a file path, the
fallback) and every worker runs the method below.

Why a memfd or a file and not tensors: collective_rpc ships its arguments with msgpack, and a tensor
arrives as a plain list (older versions: `cannot pickle memoryview objects`); see
actors/policy/vllm_weights.py. With tensor parallelism every worker maps the same payload and the model's
own loader takes its shard. Why `reload_weights` and not `model.load_weights`: on CPU, vLLM repacks
linear weights after loading (the original parameters become size-0), so a second plain `load_weights`
fails; `reload_weights` (vllm/model_executor/model_loader/reload/inplace.py) restores the checkpoint
layout per layer, loads, re-runs the post-load processing and copies the result into the original storage.

vLLM asserts that no attribute of an extension clashes with the worker's, so every name here carries the
`treeopsd_` prefix (a method named `update_weights` clashes).
This module imports no vLLM code itself (only actors/received_weights.py, for the memfd checks).
"""

from __future__ import annotations

from typing import Any


class WeightLoaderExtension:
    """Mixed into vLLM's worker; `self` is the worker (has `reload_weights`, `model_runner`)."""

    def treeopsd_load_weights(self: Any, path: str) -> int:
        """Load checkpoint-format tensors (HF names) from `path` in place; return how many were read.

        The file is NOT removed here: with tensor parallelism every worker reads the same file, so the
        driver (VLLMBackend.load_weights) removes it after all workers have answered.
        """
        from safetensors.torch import load_file

        tensors = load_file(path)  # tmpfs-backed, so this is a memcpy, not disk I/O
        # Worker.reload_weights wraps model_runner.reload_weights in the engine's config context and
        # resets the LoRA/encoder/multimodal caches; the KV prefix cache is reset by the driver.
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)

    def treeopsd_load_shared(self: Any, source: dict[str, Any]) -> int:
        """Load the tensors described by `source` (actors/policy/vllm_weights.py:SharedWeights.stage, or
        actors/received_weights.py:SealedMemfd.describe for a received version) from the memfd the sampler
        holds, mapped copy-on-write (never written, so never copied); return how many."""
        import mmap
        import os

        import torch

        from actors.received_weights import is_sealed, prefault

        fd = os.open(source["path"], os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (source["dev"], source["ino"]) or st.st_size < source["size"]:
                raise RuntimeError(f"treeopsd: {source['path']} is not the sampler's weight memfd")
            if source.get("sealed") and not is_sealed(fd):
                raise RuntimeError(f"treeopsd: {source['path']} is not sealed against writes")
            buf = mmap.mmap(fd, source["size"], mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            prefault(buf)  # read only, so its pages stay shared with the sampler's
        finally:
            os.close(fd)
        tensors = []
        for name, dtype, shape, offset, nbytes in source["tensors"]:
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else None
            t = (
                raw.view(getattr(torch, dtype))
                if raw is not None
                else torch.empty(0, dtype=getattr(torch, dtype))
            )
            tensors.append((name, t.view(shape)))
        self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        return len(tensors)  # the views (and with them the mapping) go when this frame does

    def treeopsd_param_sum(self: Any, name_contains: str) -> float:
        """Sum of the model parameters whose name contains `name_contains` (a cheap test probe)."""
        total = 0.0
        for name, param in self.model_runner.get_model().named_parameters():
            if name_contains in name:
                total += float(param.detach().double().sum())
        return total
