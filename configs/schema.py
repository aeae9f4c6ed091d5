"""The typed, validated configuration: one schema, every knob in it, unknown keys and bad values rejected.

    cfg = load_config("configs/default.yaml", overrides=["algo.rho=0.25", "sampler.backend=vllm"])

Built on pydantic v2 so that each field's type and constraint are one declaration beside the field, checked
by a well-tested validator, not a hand-written coercer plus a range checker that could drift apart. Scalars
are strict (an int is only an integer; a number also takes an int or a numeric string such as "1e-3");
rules across fields are model validators. Errors are `ConfigError`s naming the dotted key, the value and
what is allowed (rLLM's silent no-op knobs are the cautionary tale). This module imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import copy
import ipaddress
import math
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic.functional_validators import AfterValidator, BeforeValidator, model_validator
from pydantic.types import StrictBool, StrictInt, StrictStr
from pydantic_core import ErrorDetails, PydanticCustomError

_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_RHO, _PORT = "a number in the open interval (0, 1/2)", "a port number in [0, 65535]"
_HOST, _POOL = "a host name or IP address without spaces", "a name of letters, digits, '_' and '-'"
_CLIP = "a list of 2 values [low, high] with 0 < low < 1 and high > 0"
_HOPS = "a list of 2 integers [low, high] with 1 <= low <= high"
_S = TypeVar("_S", bound=BaseModel)
HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # the head sizes vLLM's CPU attention runs


class ConfigError(ValueError):
    """A configuration problem, naming the key."""


class Allowed(str):
    """Field metadata: what the field accepts, in words, where its bounds alone would not say it."""


def _number(value: Any) -> float:
    """A finite float from an int, a float or a numeric string (PyYAML reads "1e-3" as a string); no bool."""
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if numeric or (isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip())):
        with contextlib.suppress(OverflowError):  # an int too large for a float is not a number here
            if math.isfinite(out := float(value)):
                return out
    raise PydanticCustomError("config_number", "not a finite number")


def _pair(value: Any) -> Any:
    """A tuple field takes a list (or tuple) of exactly two values, nothing else iterable."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise PydanticCustomError("config_pair", "not a list of 2 values")
    return value


def _ordered(value: tuple[int, int]) -> tuple[int, int]:
    """[low, high] with low <= high."""
    if value[0] > value[1]:
        raise PydanticCustomError("config_order", "low > high")
    return value


Float = Annotated[float, BeforeValidator(_number)]
PosFloat = Annotated[Float, Field(gt=0)]
NonNegFloat = Annotated[Float, Field(ge=0)]
PosInt = Annotated[StrictInt, Field(ge=1)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
Host = Annotated[StrictStr, Field(pattern=r"^\S+$"), Allowed(_HOST)]
PoolName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]+$"), Allowed(_POOL)]
UnitFloat = Annotated[Float, Field(gt=0, lt=1)]
Clip = Annotated[tuple[UnitFloat, PosFloat], BeforeValidator(_pair), Allowed(_CLIP)]
Hops = Annotated[tuple[PosInt, PosInt], BeforeValidator(_pair), AfterValidator(_ordered), Allowed(_HOPS)]


def _rule(section: _S, ok: bool, name: str, allowed: str) -> _S:
    """A rule across fields of one section: the section back if `ok`, else an error naming field `name`."""
    if not ok:
        ctx = {"field": name, "value": getattr(section, name), "allowed": allowed}
        raise PydanticCustomError("config_rule", "{field} = {value} is invalid: expected {allowed}", ctx)
    return section


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class RunConfig(_Section):
    name: NonEmptyStr = "default"
    seed: NonNegInt = 0
    run_dir: NonEmptyStr = "runs/default"
    mode: Literal["async", "sync"] = "async"
    steps: PosInt = 20
    time_limit_s: Annotated[NonNegFloat, Field(description="0: no limit")] = 0.0
    eval_tasks: PosInt = 120


class AlgoConfig(_Section):
    method: Literal["treeopsd", "grpo", "gspo", "treepo"] = "treeopsd"
    M: PosInt = 4  # initial trajectories per prompt (tree methods)
    N: NonNegInt = 2  # branches per trajectory
    G: Annotated[StrictInt, Field(ge=2)] = 8  # group size (GRPO, GSPO)
    rho: Annotated[Float, Field(gt=0, lt=0.5), Allowed(_RHO)] = 0.1
    teacher: Literal["odds", "logistic"] = "odds"
    credit: Literal["pointwise", "listwise"] = "pointwise"
    backup_weights: Literal["uniform", "geo_likelihood", "seq_likelihood", "leaf_count"] = "uniform"
    tau_mode: Literal["per_tree", "global"] = "per_tree"
    anchor_shortfall: Literal["skip", "reallocate"] = "skip"
    zero_var_trees: Literal["keep", "drop"] = "keep"
    on_verifier_error: Literal["zero", "drop_tree"] = "zero"
    mask_truncated_turn: StrictBool = False
    behavior_logprobs: Literal["sampler", "recompute"] = "sampler"
    grpo_clip: Clip = (0.2, 0.2)
    gspo_clip: Clip = (3e-4, 4e-4)
    treepo_clip: Clip = (0.2, 0.28)
    treepo_filter_zero_std: StrictBool = False
    nonfinite_turn_limit: Annotated[Float, Field(ge=0, lt=1)] = 0.01

    @model_validator(mode="after")
    def _listwise_rho(self) -> Self:
        # |V_c − V_parent| is not bounded by the ρ calibration (system/teacher.py)
        listwise_ok = self.credit != "listwise" or self.rho < 0.25
        return _rule(self, listwise_ok, "rho", "< 0.25 with algo.credit = listwise, so q stays in (0, 1)")

    @property
    def is_tree_method(self) -> bool:
        return self.method in ("treeopsd", "treepo")

    @property
    def nominal_leaves(self) -> int:
        """K = M(1+N) for tree methods, G for flat ones."""
        return self.M * (1 + self.N) if self.is_tree_method else self.G

    @property
    def expected_cost(self) -> float:
        """Full-trajectory equivalents per prompt, docs/algorithm.md §2.3: M(1 + N/2), or G."""
        return self.M * (1 + self.N / 2) if self.is_tree_method else float(self.G)


class TinyModelConfig(_Section):
    hidden: PosInt = 64
    layers: PosInt = 2
    heads: PosInt = 2
    kv_heads: PosInt = 1
    vocab: PosInt = 1024

    @model_validator(mode="after")
    def _shapes(self) -> Self:
        hidden, heads, kv_heads = self.hidden, self.heads, self.kv_heads
        _rule(self, hidden % heads == 0, "heads", f"a divisor of model.tiny.hidden ({hidden})")
        _rule(self, heads % kv_heads == 0, "kv_heads", f"a divisor of model.tiny.heads ({heads})")
        why = f"hidden / heads (the head dim, {hidden // heads} here) to be one of {str(HEAD_DIMS)[1:-1]}"
        return _rule(self, hidden // heads in HEAD_DIMS, "hidden", why)


class ModelConfig(_Section):
    path: NonEmptyStr | None = None  # None: the tiny model, warm-started (cached in run_dir/../models)
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    warmstart_steps: PosInt = 1200
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: PosInt = 1


class EnvConfig(_Section):
    name: Literal["synthetic_kb", "multihop_qa", "deep_research"] = "synthetic_kb"
    data: NonEmptyStr | None = None  # dataset file for multihop_qa / deep_research
    corpus: NonEmptyStr | None = None
    eval_data: NonEmptyStr | None = None
    max_turns: PosInt = 6
    max_turn_tokens: PosInt = 48
    token_budget: PosInt = 768  # whole-context limit (prompt + turns + observations)
    topk: PosInt = 2
    seed: NonNegInt = 0
    train_hops: Hops = (2, 2)
    eval_hops: Hops = (2, 4)

    @model_validator(mode="after")
    def _turn_fits_budget(self) -> Self:
        ok, budget = self.max_turn_tokens <= self.token_budget, self.token_budget
        return _rule(self, ok, "max_turn_tokens", f"an integer <= env.token_budget ({budget})")


class SamplerConfig(_Section):
    backend: Literal["hf", "vllm"] = "hf"
    num_samplers: PosInt = 2
    temperature: PosFloat = 1.0
    top_p: Annotated[Float, Field(gt=0, le=1)] = 1.0
    prompts_per_request: PosInt = 1
    max_restarts: NonNegInt = 3


class LearnerConfig(_Section):
    batch_trees: PosInt = 8  # B: trees (prompts) per fixed rollout batch
    minibatches: PosInt = 4
    epochs: PosInt = 1
    lr: PosFloat = 3e-4
    weight_decay: NonNegFloat = 0.0
    grad_clip: Annotated[NonNegFloat, Field(description="0 disables clipping")] = 1.0
    packed_forward: StrictBool = True
    checkpoint_every: PosInt = 1  # learner steps between checkpoints


class StoreConfig(_Section):
    dir: NonEmptyStr | None = None  # None: run_dir/store
    eta: Annotated[NonNegInt, Field(description="0: synchronous")] = 1  # max policy-version lag (AReaL's η)


class WeightsConfig(_Section):
    bind_host: Host = "127.0.0.1"
    port: Annotated[StrictInt, Field(ge=0, le=65535, description="0: pick a free port"), Allowed(_PORT)] = 0
    chunk_mb: PosInt = 4
    auth: Literal["none", "curve"] = "none"  # must be "curve" when bind_host is not loopback

    @model_validator(mode="after")
    def _auth_off_loopback(self) -> Self:
        ok = is_loopback(self.bind_host) or self.auth == "curve"
        return _rule(self, ok, "auth", "'curve' when weights.bind_host is not loopback")


def is_loopback(host: str) -> bool:
    """localhost, ::1 or any 127.x.y.z (as learner/weight_publisher.py decides); not wildcards, not names."""
    with contextlib.suppress(ValueError):
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    return False


class RoleResources(_Section):
    num_cpus: NonNegFloat = 1.0
    num_gpus: NonNegFloat = 0.0
    pool: PoolName | None = None  # a Ray custom resource "pool_<name>" the role must land on


class ResourcesConfig(_Section):
    sampler: RoleResources = Field(default_factory=RoleResources)
    learner: RoleResources = Field(default_factory=RoleResources)
    backup: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=0.0))
    store: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=0.0))


class LoggingConfig(_Section):
    tensorboard: StrictBool = True
    progress: StrictBool = True


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @property
    def store_dir(self) -> str:
        return self.store.dir or str(Path(self.run.run_dir) / "store")

    @property
    def admission_eta(self) -> int:
        """`store.eta`, or 0 in `run.mode = sync` (the synchronous baseline: the same topology, η = 0)."""
        return 0 if self.run.mode == "sync" else self.store.eta


# ---- pydantic's errors as one ConfigError: key, value, what is allowed ---------------------------------


def unwrap(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any], bool]:
    """(bare type, all its metadata, nullable) of a field's annotation: `X | None` and Annotated peeled."""
    tp, meta, nullable = annotation, list(metadata), False
    if get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        tp, nullable = inner[0], len(inner) < len(get_args(tp))
    while get_origin(tp) is Annotated:
        tp, *extra = get_args(tp)
        for m in extra:
            meta.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    return tp, meta, nullable


def _words(tp: Any, meta: list[Any]) -> str:
    """What a scalar field accepts, in words, from its type and bounds."""
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a non-empty string" if any(getattr(m, "min_length", 0) for m in meta) else "a string"
    if get_origin(tp) is tuple:
        return f"a list of {len(get_args(tp))} values"
    noun = "an integer" if tp is int else "a number"
    b = {k: v for m in meta for k in ("gt", "ge", "lt", "le") if (v := getattr(m, k, None)) is not None}
    lo, hi = next((k for k in ("gt", "ge") if k in b), ""), next((k for k in ("lt", "le") if k in b), "")
    if lo and hi:
        if (lo, hi) == ("gt", "lt"):
            return f"{noun} in the open interval ({b[lo]}, {b[hi]})"
        return f"{noun} in {'(['[lo == 'ge']}{b[lo]}, {b[hi]}{')]'[hi == 'le']}"
    sign = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    return f"{noun} {sign[lo or hi]} {b[lo or hi]}" if lo or hi else noun


def expected(info: FieldInfo) -> str:
    """The "expected ..." / "allowed values are ..." part of a field's error message."""
    tp, meta, nullable = unwrap(info.annotation, info.metadata)
    if get_origin(tp) is Literal:
        return f"allowed values are {', '.join(map(repr, get_args(tp)))}"
    words = next((str(m) for m in meta if isinstance(m, Allowed)), None) or _words(tp, meta)
    words += " or null" if nullable else ""
    words += f" ({info.description})" if info.description else ""
    return f"expected {words}"


def _message(e: ErrorDetails, data: dict[str, Any]) -> str:
    model: type[BaseModel] = Config
    path: list[str] = []
    info: FieldInfo | None = None
    raw: Any = data  # the value as given, walked along with the key
    for part in e["loc"]:
        if info is not None:
            break  # inside a field's value (an element of a list): the field is what gets reported
        name = str(part)
        if name not in model.model_fields:
            keys = ", ".join(sorted(model.model_fields))
            return f"unknown key {'.'.join([*path, name])}; allowed keys: {keys}"
        path.append(name)
        info, raw = (
            model.model_fields[name],
            raw.get(name, e["input"]) if isinstance(raw, dict) else e["input"],
        )
        if isinstance(sub := info.annotation, type) and issubclass(sub, BaseModel):
            model, info = sub, None  # a section: go on into it
    where = ".".join(path) or "config"
    if e["type"] == "config_rule":
        ctx = e.get("ctx") or {}
        return f"{'.'.join([*path, ctx['field']])} = {ctx['value']!r} is invalid: expected {ctx['allowed']}"
    if info is None:
        if e["type"] == "model_type":
            return f"{where} must be a mapping, got {type(e['input']).__name__}"
        return f"{where} is invalid: {e['msg']}"
    if unwrap(info.annotation, info.metadata)[0] is float:
        with contextlib.suppress(PydanticCustomError):
            raw = _number(raw)  # shown as the number it stands for: `algo.rho=0` -> 0.0
    return f"{where} = {raw!r} is invalid: {expected(info)}"


# ---- building configs from plain data ---------------------------------------------------------------------


def to_dict(cfg: BaseModel) -> dict[str, Any]:
    """Plain-data form (tuples as lists) for YAML/JSON and for shipping to actors."""
    return cfg.model_dump(mode="json")


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
    """Validates plain data (plus overrides) into a Config; the first problem, in field order, is raised."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    data = apply_overrides(copy.deepcopy(data or {}), list(overrides or []))
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_message(err.errors(include_url=False)[0], data)) from None


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
