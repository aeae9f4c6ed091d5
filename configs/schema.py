"""The typed, validated configuration: one schema, every knob in it, unknown keys and bad values rejected.

    cfg = load_config("configs/default.yaml", overrides=["algo.rho=0.25", "sampler.backend=vllm"])

Errors are `ConfigError`s naming the dotted key, the value and what is allowed (rLLM's silent no-op knobs are
the cautionary tale). Derived values are properties. This module imports nothing of ours.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


class ConfigError(ValueError):
    """A configuration problem, naming the key."""


@dataclass(frozen=True)
class RunConfig:
    name: str = "default"
    seed: int = 0
    run_dir: str = "runs/default"
    mode: Literal["async", "sync"] = "async"
    steps: int = 20
    time_limit_s: float = 0.0  # 0: no limit
    eval_tasks: int = 120


@dataclass(frozen=True)
class AlgoConfig:
    method: Literal["treeopsd", "grpo", "gspo", "treepo"] = "treeopsd"
    M: int = 4  # initial trajectories per prompt (tree methods)
    N: int = 2  # branches per trajectory
    G: int = 8  # group size (GRPO, GSPO)
    rho: float = 0.1
    teacher: Literal["odds", "logistic"] = "odds"
    credit: Literal["pointwise", "listwise"] = "pointwise"
    backup_weights: Literal["uniform", "geo_likelihood", "seq_likelihood", "leaf_count"] = "uniform"
    tau_mode: Literal["per_tree", "global"] = "per_tree"
    anchor_shortfall: Literal["skip", "reallocate"] = "skip"
    zero_var_trees: Literal["keep", "drop"] = "keep"
    on_verifier_error: Literal["zero", "drop_tree"] = "zero"
    mask_truncated_turn: bool = False
    behavior_logprobs: Literal["sampler", "recompute"] = "sampler"
    grpo_clip: tuple[float, float] = (0.2, 0.2)
    gspo_clip: tuple[float, float] = (3e-4, 4e-4)
    treepo_clip: tuple[float, float] = (0.2, 0.28)
    treepo_filter_zero_std: bool = False
    nonfinite_turn_limit: float = 0.01

    @property
    def is_tree_method(self) -> bool:
        return self.method in ("treeopsd", "treepo")

    @property
    def nominal_leaves(self) -> int:
        """K = M(1+N) for tree methods, G for flat ones."""
        return self.M * (1 + self.N) if self.is_tree_method else self.G

    @property
    def expected_cost(self) -> float:
        """Full-trajectory equivalents per prompt, algorithm.md §2.3: M(1 + N/2), or G."""
        return self.M * (1 + self.N / 2) if self.is_tree_method else float(self.G)


@dataclass(frozen=True)
class TinyModelConfig:
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    vocab: int = 1024


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # None: build the tiny model and warm-start it (cached in run_dir/../models)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    warmstart_steps: int = 1200
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int = 1


@dataclass(frozen=True)
class EnvConfig:
    name: Literal["synthetic_kb", "multihop_qa", "deep_research"] = "synthetic_kb"
    data: str | None = None  # dataset file for multihop_qa / deep_research
    corpus: str | None = None
    eval_data: str | None = None
    max_turns: int = 6
    max_turn_tokens: int = 48
    token_budget: int = 768
    topk: int = 2
    seed: int = 0
    train_hops: tuple[int, int] = (2, 2)
    eval_hops: tuple[int, int] = (2, 4)


@dataclass(frozen=True)
class SamplerConfig:
    backend: Literal["hf", "vllm"] = "hf"
    num_samplers: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    prompts_per_request: int = 1
    max_restarts: int = 3


@dataclass(frozen=True)
class LearnerConfig:
    batch_trees: int = 8  # B: trees (prompts) per fixed rollout batch
    minibatches: int = 4
    epochs: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    packed_forward: bool = True
    checkpoint_every: int = 1


@dataclass(frozen=True)
class StoreConfig:
    dir: str | None = None  # None: run_dir/store
    eta: int = 1  # max policy-version lag admitted (AReaL's η); 0 = synchronous


@dataclass(frozen=True)
class WeightsConfig:
    bind_host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    chunk_mb: int = 4
    auth: Literal["none", "curve"] = "none"  # must be "curve" when bind_host is not loopback


@dataclass(frozen=True)
class RoleResources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    pool: str | None = None  # a Ray custom resource "pool_<name>" the role must land on


@dataclass(frozen=True)
class ResourcesConfig:
    sampler: RoleResources = field(default_factory=RoleResources)
    learner: RoleResources = field(default_factory=RoleResources)
    backup: RoleResources = field(default_factory=lambda: RoleResources(num_cpus=0.0))
    store: RoleResources = field(default_factory=lambda: RoleResources(num_cpus=0.0))


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    progress: bool = True


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def store_dir(self) -> str:
        return self.store.dir or str(Path(self.run.run_dir) / "store")


# ---- checks on values (ranges and cross-field rules) --------------------------------------------------


def _check_values(cfg: Config) -> None:
    a = cfg.algo
    _require(0 < a.rho < 0.5, "algo.rho", a.rho, "a number in the open interval (0, 1/2)")
    if a.credit == "listwise":  # |V_c − V_parent| is not bounded by the ρ calibration (system/teacher.py)
        _require(a.rho < 0.25, "algo.rho", a.rho, "< 0.25 with algo.credit = listwise, so q stays in (0, 1)")
    _require(a.M >= 1, "algo.M", a.M, "an integer >= 1")
    _require(a.N >= 0, "algo.N", a.N, "an integer >= 0")
    _require(a.G >= 2, "algo.G", a.G, "an integer >= 2")
    for key, (lo, hi) in (
        ("grpo_clip", a.grpo_clip),
        ("gspo_clip", a.gspo_clip),
        ("treepo_clip", a.treepo_clip),
    ):
        _require(0 < lo < 1 and hi > 0, f"algo.{key}", (lo, hi), "(low, high) with 0 < low < 1 and high > 0")
    _require(0 <= a.nonfinite_turn_limit < 1, "algo.nonfinite_turn_limit", a.nonfinite_turn_limit, "[0, 1)")
    _require(cfg.env.max_turns >= 1, "env.max_turns", cfg.env.max_turns, "an integer >= 1")
    _require(cfg.env.max_turn_tokens >= 1, "env.max_turn_tokens", cfg.env.max_turn_tokens, "an integer >= 1")
    _require(
        cfg.sampler.num_samplers >= 1, "sampler.num_samplers", cfg.sampler.num_samplers, "an integer >= 1"
    )
    _require(cfg.sampler.temperature > 0, "sampler.temperature", cfg.sampler.temperature, "a number > 0")
    _require(0 < cfg.sampler.top_p <= 1, "sampler.top_p", cfg.sampler.top_p, "a number in (0, 1]")
    ln = cfg.learner
    _require(ln.batch_trees >= 1, "learner.batch_trees", ln.batch_trees, "an integer >= 1")
    _require(ln.minibatches >= 1, "learner.minibatches", ln.minibatches, "an integer >= 1")
    _require(ln.lr > 0, "learner.lr", ln.lr, "a number > 0")
    _require(ln.grad_clip >= 0, "learner.grad_clip", ln.grad_clip, "a number >= 0 (0 disables clipping)")
    _require(cfg.store.eta >= 0, "store.eta", cfg.store.eta, "an integer >= 0")
    w = cfg.weights
    _require(0 <= w.port < 65536, "weights.port", w.port, "a port number in [0, 65535]")
    _require(w.chunk_mb >= 1, "weights.chunk_mb", w.chunk_mb, "an integer >= 1")
    loopback = w.bind_host in ("127.0.0.1", "localhost", "::1")
    _require(
        loopback or w.auth == "curve",
        "weights.auth",
        w.auth,
        "'curve' when weights.bind_host is not loopback",
    )
    for role in ("sampler", "learner", "backup", "store"):
        r = getattr(cfg.resources, role)
        _require(
            r.num_cpus >= 0 and r.num_gpus >= 0, f"resources.{role}", r, "non-negative num_cpus/num_gpus"
        )


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r} is invalid: expected {allowed}")


# ---- building dataclasses from plain dicts, strictly ------------------------------------------------------


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Builds dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError naming them."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}; allowed keys: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {
        name: _coerce(hints[name], value, f"{prefix}.{name}" if prefix else name)
        for name, value in data.items()
    }
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(
                f"{key} = {value!r} is invalid: allowed values are {', '.join(map(repr, args))}"
            )
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key} = {value!r} is invalid: expected a list of {len(args)} values")
        return tuple(_coerce(t, v, f"{key}[{i}]") for i, (t, v) in enumerate(zip(args, value, strict=True)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} is invalid: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r} is invalid: expected an integer")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)  # PyYAML (YAML 1.1) reads "1e-3" as a string; YAML 1.2 says float
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} = {value!r} is invalid: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r} is invalid: expected a string")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-data form (tuples as lists) for YAML/JSON and for shipping to actors."""
    out = dataclasses.asdict(cfg)

    def fix(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, tuple | list):
            return [fix(v) for v in x]
        return x

    fixed: dict[str, Any] = fix(out)
    return fixed


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`key.sub=value` overrides, values parsed as YAML (`algo.rho=0.25`, `env.train_hops=[2,3]`)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def parse_config(data: dict[str, Any] | None, overrides: list[str] | None = None) -> Config:
    data = apply_overrides(dict(data or {}), list(overrides or []))
    cfg: Config = from_dict(Config, data)
    _check_values(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Loads a YAML file (default: the embedded configs/default.yaml) and applies overrides."""
    path = Path(path) if path else Path(__file__).with_name("default.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return parse_config(data, overrides)
