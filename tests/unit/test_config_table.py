"""Every knob is checked: a table of bad values across all sections, each rejected with a ConfigError naming
the dotted key and what is allowed; every schema field carries a check; the shipped config files load."""

from __future__ import annotations

import json
import pickle
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import pytest
import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field
from pydantic.fields import FieldInfo
from pydantic.types import Strict

from configs.schema import (
    AlgoConfig,
    Config,
    ConfigError,
    RoleResources,
    TinyModelConfig,
    WeightsConfig,
    load_config,
    parse_config,
    to_dict,
)

ROOT = Path(__file__).resolve().parents[2]
INT1, NUM0 = "expected an integer >= 1", "expected a number >= 0"

BAD = [
    # run
    ("run.steps=0", rf"^run\.steps = 0 is invalid: {INT1}"),
    ("run.steps='3'", rf"^run\.steps = '3' is invalid: {INT1}"),
    ("run.time_limit_s=-1", rf"^run\.time_limit_s = -1\.0 is invalid: {NUM0}"),
    ("run.eval_tasks=0", rf"^run\.eval_tasks = 0 is invalid: {INT1}"),
    ("run.seed=-1", r"^run\.seed = -1 is invalid: expected an integer >= 0"),
    ("run.max_learner_restarts=-1", r"^run\.max_learner_restarts = -1 is invalid: expected an integer >= 0"),
    ("run.max_store_restarts=1.5", r"^run\.max_store_restarts = 1\.5 is invalid: expected an integer >= 0"),
    ("run.max_backup_restarts='x'", r"^run\.max_backup_restarts = 'x' is invalid: expected an integer >= 0"),
    ("run.mode=parallel", r"^run\.mode = 'parallel' is invalid: allowed values are 'async', 'sync'"),
    ("run.run_dir=''", r"^run\.run_dir = '' is invalid: expected a non-empty string"),
    ("run.name=7", r"^run\.name = 7 is invalid: expected a non-empty string"),
    # algo
    ("algo.M=true", rf"^algo\.M = True is invalid: {INT1}"),
    ("algo.N=-1", r"^algo\.N = -1 is invalid: expected an integer >= 0"),
    ("algo.G=1", r"^algo\.G = 1 is invalid: expected an integer >= 2"),
    ("algo.rho=0.5", r"^algo\.rho = 0\.5 is invalid: expected a number in the open interval \(0, 1/2\)"),
    (
        "algo.nonfinite_turn_limit=1",
        r"^algo\.nonfinite_turn_limit = 1\.0 is invalid: expected a number in \[0, 1\)",
    ),
    (
        "algo.gspo_clip=[0, 1]",
        r"^algo\.gspo_clip = \[0, 1\] is invalid: expected a list of 2 values \[low, high\]",
    ),
    ("algo.treepo_clip=[0.2, 0.3, 0.4]", r"^algo\.treepo_clip = .* expected a list of 2 values"),
    ("algo.credit=listwise", r"^algo\.rho = 0\.25 is invalid: expected < 0\.25 with algo\.credit = listwise"),
    ("algo.mask_truncated_turn=2", r"^algo\.mask_truncated_turn = 2 is invalid: expected true or false"),
    ("algo.method=ppo", r"^algo\.method = 'ppo' is invalid: allowed values are 'treeopsd', 'grpo'"),
    # model, model.tiny
    ("model.warmstart_steps=0", rf"^model\.warmstart_steps = 0 is invalid: {INT1}"),
    ("model.warmstart_hops=[4, 2]", r"^model\.warmstart_hops = \[4, 2\] is invalid: .*low <= high"),
    ("model.threads=0", rf"^model\.threads = 0 is invalid: {INT1}"),
    ("model.dtype=int8", r"^model\.dtype = 'int8' is invalid: allowed values are 'float32', 'bfloat16'"),
    ("model.path=''", r"^model\.path = '' is invalid: expected a non-empty string or null"),
    ("model.tiny.hidden=0", rf"^model\.tiny\.hidden = 0 is invalid: {INT1}"),
    ("model.tiny.layers=0", rf"^model\.tiny\.layers = 0 is invalid: {INT1}"),
    ("model.tiny.vocab=-5", rf"^model\.tiny\.vocab = -5 is invalid: {INT1}"),
    (
        "model.tiny.heads=3",
        r"^model\.tiny\.heads = 3 is invalid: expected a divisor of model\.tiny\.hidden \(64\)",
    ),
    (
        "model.tiny.kv_heads=3",
        r"^model\.tiny\.kv_heads = 3 is invalid: expected a divisor of model\.tiny\.heads",
    ),
    (
        "model.tiny.heads=4",
        r"^model\.tiny\.hidden = 64 is invalid: .*head dim, 16 here\) to be one of 32, 64",
    ),
    # env
    ("env.token_budget=0", rf"^env\.token_budget = 0 is invalid: {INT1}"),
    ("env.max_turn_tokens=1000", r"^env\.max_turn_tokens = 1000 is invalid: .*<= env\.token_budget \(768\)"),
    ("env.max_turns=0", rf"^env\.max_turns = 0 is invalid: {INT1}"),
    ("env.topk=0", rf"^env\.topk = 0 is invalid: {INT1}"),
    ("env.seed=-1", r"^env\.seed = -1 is invalid: expected an integer >= 0"),
    (
        "env.train_hops=[3, 2]",
        r"^env\.train_hops = \[3, 2\] is invalid: expected a list of 2 integers .*low <= high",
    ),
    ("env.eval_hops=[0, 2]", r"^env\.eval_hops = \[0, 2\] is invalid: expected a list of 2 integers"),
    ("env.train_hops=2", r"^env\.train_hops = 2 is invalid: expected a list of 2 integers"),
    ("env.name=wiki", r"^env\.name = 'wiki' is invalid: allowed values are 'synthetic_kb'"),
    ("env.protocol=hermes", r"^env\.protocol = 'hermes' is invalid: allowed values are 'plain', 'qwen3'"),
    ("env.side_calls=drop", r"^env\.side_calls = 'drop' is invalid: allowed values are 'train', 'all'"),
    ("env.enable_thinking=1", r"^env\.enable_thinking = 1 is invalid: expected true or false"),
    ("env.require_search=maybe", r"^env\.require_search = 'maybe' is invalid: expected true or false"),
    # sampler
    ("sampler.prompts_per_request=0", rf"^sampler\.prompts_per_request = 0 is invalid: {INT1}"),
    ("sampler.max_restarts=-1", r"^sampler\.max_restarts = -1 is invalid: expected an integer >= 0"),
    ("sampler.num_samplers=0", rf"^sampler\.num_samplers = 0 is invalid: {INT1}"),
    ("sampler.top_p=1.5", r"^sampler\.top_p = 1\.5 is invalid: expected a number in \(0, 1\]"),
    ("sampler.temperature=0", r"^sampler\.temperature = 0\.0 is invalid: expected a number > 0"),
    # learner
    ("learner.checkpoint_every=0", rf"^learner\.checkpoint_every = 0 is invalid: {INT1}"),
    ("learner.epochs=0", rf"^learner\.epochs = 0 is invalid: {INT1}"),
    ("learner.weight_decay=-0.1", rf"^learner\.weight_decay = -0\.1 is invalid: {NUM0}"),
    ("learner.grad_clip=-1", rf"^learner\.grad_clip = -1\.0 is invalid: {NUM0} \(0 disables clipping\)"),
    ("learner.batch_trees=2.5", rf"^learner\.batch_trees = 2\.5 is invalid: {INT1}"),
    ("learner.lr=.nan", r"^learner\.lr = nan is invalid: expected a number > 0"),
    (
        "learner.precision=fp16",
        r"^learner\.precision = 'fp16' is invalid: allowed values are 'float32', 'bfloat16'",
    ),
    ("learner.grad_checkpointing=2", r"^learner\.grad_checkpointing = 2 is invalid"),
    (
        "learner.max_tokens_per_microbatch=-1",
        r"^learner\.max_tokens_per_microbatch = -1 is invalid: expected an",
    ),
    (
        "learner.logprob_chunk_tokens=-1",
        r"^learner\.logprob_chunk_tokens = -1 is invalid: expected an integer >= 0",
    ),
    (
        "learner.tree_attention=flex",
        r"^learner\.tree_attention = 'flex' is invalid: expected 'auto' or 'chunked' without",
    ),
    ("learner.ranks=0", rf"^learner\.ranks = 0 is invalid: {INT1}"),
    ("learner.ranks=1.5", rf"^learner\.ranks = 1\.5 is invalid: {INT1}"),
    (
        "learner.collective_timeout_s=0",
        r"^learner\.collective_timeout_s = 0\.0 is invalid: expected a number > 0",
    ),
    (
        "weights.dtype=fp8",
        r"^weights\.dtype = 'fp8' is invalid: allowed values are 'auto', 'float32', 'bfloat16'",
    ),
    ("sampler.top_k=-1", r"^sampler\.top_k = -1 is invalid: expected an integer >= 0"),
    # store
    ("store.eta=1.5", r"^store\.eta = 1\.5 is invalid: expected an integer >= 0"),
    ("store.dir=''", r"^store\.dir = '' is invalid: expected a non-empty string or null"),
    # weights
    ("weights.port=70000", r"^weights\.port = 70000 is invalid: expected a port number in \[0, 65535\]"),
    ("weights.port=-1", r"^weights\.port = -1 is invalid: expected a port number in \[0, 65535\]"),
    ("weights.chunk_mb=0", rf"^weights\.chunk_mb = 0 is invalid: {INT1}"),
    ("weights.auth=tls", r"^weights\.auth = 'tls' is invalid: allowed values are 'none', 'curve'"),
    ("weights.bind_host='a b'", r"^weights\.bind_host = 'a b' is invalid: expected a host name"),
    (
        "weights.bind_host=10.0.0.1",
        r"^weights\.auth = 'none' is invalid: expected 'curve' when .*not loopback",
    ),
    # resources
    ("resources.learner.num_gpus=-1", rf"^resources\.learner\.num_gpus = -1\.0 is invalid: {NUM0}"),
    ("resources.sampler.num_cpus=-0.5", rf"^resources\.sampler\.num_cpus = -0\.5 is invalid: {NUM0}"),
    (
        "resources.sampler.pool='a b'",
        r"^resources\.sampler\.pool = 'a b' is invalid: expected a name of letters",
    ),
    (
        "resources.store.pool=''",
        r"^resources\.store\.pool = '' is invalid: expected a name of letters.* or null",
    ),
    (
        "resources.gpu.num_gpus=1",
        r"^unknown key resources\.gpu; allowed keys: backup, learner, sampler, store$",
    ),
    ("resources.learner=4", r"^resources\.learner must be a mapping, got int$"),
    # logging
    ("logging.progress=maybe", r"^logging\.progress = 'maybe' is invalid: expected true or false$"),
    ("logging.tensorboard=0", r"^logging\.tensorboard = 0 is invalid: expected true or false$"),
    (
        "logging.colour=true",
        r"^unknown key logging\.colour; allowed keys: learner_turns, log_every, mlflow, mlflow_experiment, "
        r"mlflow_uri, progress, tensorboard, wandb, wandb_project$",
    ),
]


@pytest.mark.parametrize(("override", "message"), BAD, ids=[o for o, _ in BAD])
def test_bad_value_is_rejected_naming_key_and_allowed(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(overrides=[override])
    text = str(info.value)
    assert "pydantic" not in text.lower() and "http" not in text and "\n" not in text


def test_the_table_covers_every_section() -> None:
    covered = {o.split("=")[0].rsplit(".", 1)[0] for o, _ in BAD}
    assert covered >= {*Config.model_fields, "model.tiny"} and len(BAD) >= 30


def test_first_error_in_field_order_is_reported() -> None:
    with pytest.raises(ConfigError, match=r"^run\.steps = 0"):
        load_config(overrides=["algo.M=0", "run.steps=0"])
    with pytest.raises(ConfigError, match=r"^algo\.M = 0"):
        load_config(overrides=["algo.N=-1", "algo.M=0"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["learner.lr=1e-3", "learner.weight_decay='0.01'", "algo.rho=0.3"],  # numeric strings, ints as floats
        ["env.train_hops=[1, 1]", "env.eval_hops=[2, 6]", "env.max_turn_tokens=768"],
        ["weights.bind_host=127.0.0.2"],  # any 127.x.y.z is loopback
        ["weights.bind_host=localhost"],
        ["weights.bind_host='::1'"],
        ["weights.bind_host=0.0.0.0", "weights.auth=curve", "weights.port=65535"],
        ["resources.sampler.pool=l40s_B-2", "resources.learner.num_gpus=0.5", "model.path=/models/x"],
        ["model.tiny.hidden=128", "model.tiny.heads=2", "model.tiny.kv_heads=2"],  # head dim 64
        ["run.steps=1", "run.time_limit_s=0", "sampler.max_restarts=0", "store.eta=0"],
    ],
)
def test_good_values_pass(overrides: list[str]) -> None:
    cfg = load_config(overrides=overrides)
    assert parse_config(to_dict(cfg)) == cfg


def test_types_hold_after_validation() -> None:
    cfg = load_config(overrides=["learner.lr=1e-3", "env.train_hops=[2,3]", "algo.rho=0.2"])
    assert cfg.learner.lr == 1e-3 and isinstance(cfg.learner.lr, float)
    assert cfg.env.train_hops == (2, 3) and isinstance(cfg.env.train_hops, tuple)
    assert isinstance(cfg.algo.grpo_clip, tuple) and isinstance(cfg.resources.backup, RoleResources)
    assert cfg.resources.backup.num_cpus == 0.0 and cfg.resources.sampler.num_cpus == 1.0


def test_frozen_equal_picklable_and_plain_data() -> None:
    cfg = load_config()
    with pytest.raises(ValueError, match="Instance is frozen"):
        cfg.algo.rho = 0.2  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(cfg) == hash(load_config())
    data = to_dict(cfg)
    assert json.loads(json.dumps(data)) == data == yaml.safe_load(yaml.safe_dump(data))
    assert data["env"]["train_hops"] == [4, 5] and data["model"]["path"] is None
    assert parse_config(yaml.safe_load(yaml.safe_dump(data))) == cfg


def test_overrides_do_not_touch_the_callers_data() -> None:
    data = {"algo": {"rho": 0.1}}
    assert parse_config(data, ["algo.rho=0.2"]).algo.rho == 0.2 and data == {"algo": {"rho": 0.1}}
    with pytest.raises(ConfigError, match=r"^config must be a mapping, got list$"):
        parse_config([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^algo must be a mapping, got NoneType$"):
        parse_config({"algo": None})


def test_direct_construction_validates_too() -> None:
    assert AlgoConfig(rho=0.25).rho == 0.25 and TinyModelConfig().hidden // TinyModelConfig().heads == 32
    with pytest.raises(ValueError, match=r"expected 'curve' when weights\.bind_host is not loopback"):
        WeightsConfig(bind_host="10.0.0.1")
    # the algo section's `auto` values are filled in for the run's mode (async: step_start, token_tis)
    resolved = AlgoConfig(proximal="step_start", rollout_correction="token_tis")
    assert Config().algo == resolved and parse_config({}) == Config()


# ---- every field carries a check ---------------------------------------------------------------

BOUNDS = (at.Gt, at.Ge, at.Lt, at.Le, at.MinLen, at.MaxLen, at.MultipleOf, at.Predicate, AfterValidator)


def _peel(tp: Any, meta: list[Any]) -> tuple[Any, list[Any]]:
    """The type under Annotated[...] and all metadata on the way (FieldInfo's own metadata flattened)."""
    meta = list(meta)
    while get_origin(tp) is Annotated:
        tp, *extra = get_args(tp)
        meta += [x for m in extra for x in (m.metadata if isinstance(m, FieldInfo) else [m])]
    return tp, meta


def _checked(tp: Any, meta: list[Any]) -> bool:
    tp, meta = _peel(tp, meta)
    if get_origin(tp) is Literal or tp is bool:
        return tp is not bool or any(isinstance(m, Strict) and m.strict for m in meta)
    if any(isinstance(m, BOUNDS) or getattr(m, "pattern", None) for m in meta):
        # strict too: 2.5 or "3" is no integer, 3 is no string, true is no number (messages.finite_number)
        if tp is float:
            return any(isinstance(m, BeforeValidator) for m in meta)
        return tp not in (int, str) or any(isinstance(m, Strict) and m.strict for m in meta)
    if get_origin(tp) in (Union, types.UnionType, tuple):
        return all(_checked(a, []) for a in get_args(tp) if a is not type(None))
    return False


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, FieldInfo]]:
    out = []
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += _fields(sub, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", info))
    return out


def test_every_field_has_a_literal_bool_or_constraint() -> None:
    fields = _fields(Config)
    assert (
        len(fields) > 70
        and {"model.tiny.hidden", "resources.store.pool", "logging.progress"} <= dict(fields).keys()
    )
    unchecked = [key for key, info in fields if not _checked(info.annotation, list(info.metadata))]
    assert unchecked == [], f"fields without a Literal, strict bool or constraint: {unchecked}"


def test_the_introspection_notices_an_unchecked_knob() -> None:
    class Knobs(BaseModel):
        plain_int: int = 1
        plain_bool: bool = True
        plain_opt: str | None = None
        plain_pair: tuple[float, float] = (0.0, 1.0)
        lax_int: Annotated[int, Field(ge=1)] = 1
        lax_float: Annotated[float, Field(gt=0)] = 1.0

    assert [k for k, info in _fields(Knobs) if _checked(info.annotation, list(info.metadata))] == []


# ---- the shipped config files ------------------------------------------------------------------


def _overrides(mapping: dict[str, Any]) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in mapping.items()]


def test_shipped_configs_load() -> None:
    assert load_config(ROOT / "configs" / "default.yaml") == load_config()
    cluster = load_config(ROOT / "configs" / "cluster_example.yaml")
    assert cluster.resources.learner.pool == "train" and cluster.sampler.backend == "vllm"
    spec = yaml.safe_load((ROOT / "configs" / "paper_table.yaml").read_text())
    if spec.get("base"):
        base = ROOT / spec["base"]
        common = _overrides(spec.get("common") or {})
        assert load_config(base, common).env.eval_hops == (4, 5)
        for row in spec["rows"]:
            load_config(base, [*common, *_overrides(row.get("set") or {})])
