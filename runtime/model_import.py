"""A GGUF model file as a Hugging Face folder (`treeopsd model import`, and every command given a .gguf).

    folder = import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "runs/models/smollm2")   # ~20 s on 2 cores
    folder = cached_import(path, "runs/models")          # runs/models/gguf-<digest>, converted once

transformers de-quantizes a GGUF on load (`gguf_file=`, needs the `gguf` and `accelerate` packages: the
`gguf` extra), but refuses `save_pretrained` of such a model ("quantized with gguf and is not
serializable"). So (docs/protocols.md §7): drop `config.quantization_config`, build the architecture
with `from_config`, `load_state_dict` the de-quantized weights, and save that model and the tokenizer
(with its chat template). The folder is written beside OUT and renamed into place once `import.json` is
in it, so a reader sees no folder or a whole one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from storage.durable import write_atomic

MARKER = "import.json"
EXTRA_HINT = "pip install -e '.[gguf]' (the gguf and accelerate packages)"


class ModelImportError(ValueError):
    """A GGUF file that cannot be imported; the message names the file and what is needed."""


def missing_packages() -> list[str]:
    return [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]


def import_gguf(src: str | Path, out: str | Path, dtype: str = "bfloat16") -> dict[str, Any]:
    """Converts `src` (.gguf) into the HF folder `out` (must not exist); returns what import.json holds."""
    src, out = Path(src).expanduser(), Path(out).expanduser()
    if not src.exists():
        raise ModelImportError(f"{src}: no such file; expected a .gguf model file")
    if not src.is_file() or src.suffix != ".gguf":
        raise ModelImportError(f"{src}: not a .gguf model file")
    if out.exists():
        raise ModelImportError(f"{out}: already exists; pick a new output folder")
    if missing := missing_packages():
        raise ModelImportError(f"{src}: importing a .gguf needs {' and '.join(missing)}: {EXTRA_HINT}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {"gguf_file": src.name, "local_files_only": True}
    torch_dtype = getattr(torch, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, dtype=torch_dtype, **kwargs)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:  # an architecture transformers can't read
        raise ModelImportError(f"{src}: transformers cannot load this GGUF: {exc}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # else save_pretrained refuses a GGUF-loaded model
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        report = {
            "source": str(src.resolve()),
            "architecture": type(model).__name__,
            "params": sum(p.numel() for p in model.parameters()),
            "dtype": dtype,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        write_atomic(tmp / MARKER, json.dumps(report, indent=2).encode())
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**report, "out": str(out)}


def cached_import(src: str | Path, models_dir: str | Path) -> str:
    """`src` imported once into `models_dir/gguf-<digest>` (the digest of its path, size and mtime)."""
    p = Path(src).expanduser().resolve()
    stat = p.stat()
    digest = hashlib.sha256(f"{p}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = Path(models_dir) / f"gguf-{p.stem}-{digest}"
    if not (out / MARKER).is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        import_gguf(p, out)
    return str(out)
