"""The typed, validated configuration: one schema, every knob in it, unknown keys and bad values rejected.

    cfg = load_config("configs/default.yaml", overrides=["algo.rho=0.25", "sampler.backend=vllm"])

Built on pydantic v2 so that each field's type and constraint are one declaration beside the field, checked
by a well-tested validator, not a hand-written coercer plus a range checker that could drift apart. Scalars
are strict (an int is only an integer; a number also takes an int or a numeric string such as "1e-3");
rules across fields are model validators. Errors are `ConfigError`s naming the dotted key, the value and
what is allowed (rLLM's silent no-op knobs are the cautionary tale). This module imports nothing of ours.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import BaseModel, Field, ValidationError
from pydantic.functional_validators import AfterValidator, model_validator
from pydantic.types import StrictBool, StrictInt, StrictStr

from configs.algo import AlgoConfig, resolve_offpolicy
from configs.engine_args import check_engine_args
from configs.fields import (
    HEAD_DIMS,
    PORT_ALLOWED,
    Float,
    Hops,
    Host,
    NonEmptyStr,
    NonNegFloat,
    NonNegInt,
    PoolName,
    PosFloat,
    PosInt,
    Section,
    Url,
    rule,
)
from configs.gym import GymEnvKeys
from configs.lora import LoraConfig
from configs.messages import Allowed, message
from configs.weights import WeightsConfig, is_loopback


class ConfigError(ValueError):
    """A configuration problem, naming the key."""


AGENT_TOKEN_ENV = "TREEOPSD_AGENT_TOKEN"  # env.agent_token's fallback (actors/external/endpoint.py)


_Section = Section


class RunConfig(_Section):
    name: NonEmptyStr = "default"
    seed: NonNegInt = 0
    run_dir: NonEmptyStr = "runs/default"
    mode: Literal["async", "sync"] = "async"
    steps: PosInt = 20
    time_limit_s: Annotated[NonNegFloat, Field(description="0: no limit")] = 0.0
    eval_tasks: PosInt = 120
    eval_samples: NonNegInt = 0  # temperature-1 episodes per eval task beside the greedy one (demo)
    # an evaluation that runs alone (`treeopsd demo`, `train --eval`: before or after training, nothing else
    # on the CPU) splits its episodes over this many threads, each with its own backend on model.threads
    eval_workers: PosInt = 1
    # self-healing (runtime/supervision.py): a dead or failed learner (any rank) is restarted inside the run
    # from its newest checkpoint at most this many times; 0: the run stops and waits for --resume
    max_learner_restarts: NonNegInt = 3
    max_store_restarts: NonNegInt = 3  # the store actor, restarted by Ray: it reopens from disk
    max_backup_restarts: NonNegInt = 10  # the backup actor is stateless: its leased trees come back
    # in-process runs only (runtime/local.py; the staleness table): samplers get the learner's weights this
    # many versions late, a controlled lag; `treeopsd train` (Ray) refuses it above 0
    sampler_lag: NonNegInt = 0


class TinyModelConfig(_Section):
    hidden: PosInt = 64
    layers: PosInt = 2
    heads: PosInt = 2
    kv_heads: PosInt = 1
    vocab: PosInt = 1024

    @model_validator(mode="after")
    def _shapes(self) -> Self:
        hidden, heads, kv_heads = self.hidden, self.heads, self.kv_heads
        rule(self, hidden % heads == 0, "heads", f"a divisor of model.tiny.hidden ({hidden})")
        rule(self, heads % kv_heads == 0, "kv_heads", f"a divisor of model.tiny.heads ({heads})")
        why = f"hidden / heads (the head dim, {hidden // heads} here) to be one of {str(HEAD_DIMS)[1:-1]}"
        return rule(self, hidden // heads in HEAD_DIMS, "hidden", why)


class ModelConfig(_Section):
    path: NonEmptyStr | None = None  # None: the tiny model, warm-started (cached in run_dir/../models)
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    warmstart_steps: PosInt = 1200
    # hop counts of the tiny model's SFT trajectories: it answers most of those, and few one hop beyond
    warmstart_hops: Hops = (2, 4)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: PosInt = 1


class EnvConfig(GymEnvKeys):  # env.factory, env.python, … of env.name = gym: configs/gym.py
    name: Literal["synthetic_kb", "multihop_qa", "deep_research", "gym"] = "synthetic_kb"
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
    eval_per_hop: Annotated[StrictInt, Field(ge=1, le=500)] = 40  # synthetic KB: questions per hop count
    eval_split: Literal["eval", "val"] = "eval"  # synthetic KB: val is disjoint from eval (for tuning)
    retriever: Literal["local", "service"] = "local"  # local: in-process index; service: a /retrieve server
    retriever_url: Url | None = None  # unset with "service": `treeopsd train` starts one for all samplers
    retriever_token: NonEmptyStr | None = None  # unset: $TREEOPSD_RETRIEVER_TOKEN, if any
    retriever_timeout_s: PosFloat = 10.0  # per HTTP request
    retriever_retries: NonNegInt = 2  # retries after a failed request, with exponential backoff
    index: Literal["bm25", "dense"] = "bm25"
    encoder: NonEmptyStr | None = None  # a local sentence-transformers folder (index = dense)
    # How the agent writes calls and sees results (actors/protocols): plain `search: …` lines, Qwen3
    # `<tool_call>` JSON through the chat template's tools=, Search-R1 tags; auto: qwen3 when the
    # tokenizer's chat template handles tools, else plain
    protocol: Literal["plain", "qwen3", "search_r1", "auto"] = "plain"
    enable_thinking: StrictBool = True  # passed to the chat template (Qwen3: false adds an empty <think>)
    require_search: StrictBool = False  # an answer given before any search call gets reward 0
    reward: Literal["em", "f1"] = "em"  # an answer's training reward; evaluation's success is EM
    # synthetic KB: each turn opens with a free-text thinking span of this many tokens (a multiple of 8,
    # ≤ 512; actors/envs/thinking.py), the warm start trained to write it; 0: no thinking
    think_tokens: Annotated[NonNegInt, Field(le=512, multiple_of=8)] = 0
    # Bring your own agent (docs/external-agents.md): "module:function" run_episode(task, base_url, session)
    # driving the policy through an OpenAI-compatible endpoint; the tasks and tools are env.name's
    harness: (
        Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"), Allowed("'module:function'")]
        | None
    ) = None
    harness_timeout_s: PosFloat = 120.0  # one run of the harness; past it the episode is dropped
    harness_max_failures: PosInt = 32  # episodes (trunks) dropped in a row that stop the run, naming it
    reward_timeout_s: NonNegFloat = 10.0  # a run that returned None: wait this long for POST /v1/reward
    agent_host: Host = "127.0.0.1"  # the endpoint's bind address (not loopback: needs env.agent_token)
    # 0: a free port per sampler; a fixed port P: sampler i binds P + i (RUN_DIR/agent_endpoints.json)
    agent_port: Annotated[StrictInt, Field(ge=0, le=65535), Allowed(PORT_ALLOWED)] = 0
    agent_token: NonEmptyStr | None = None  # unset: $TREEOPSD_AGENT_TOKEN, if any
    # side calls (outside the episodes' lines): linked trees with signal, all of them, or counted only
    side_calls: Literal["train", "all", "exclude"] = "train"
    # a request changing a conversation's tools: a 409 (refuse), or a new context of the episode (continue)
    tool_change: Literal["refuse", "continue"] = "refuse"
    agent_wait_s: PosFloat = 10.0  # remote:queued: an episode no agent takes while none calls this long

    @model_validator(mode="after")
    def _retriever_rules(self) -> Self:
        ok = self.retriever == "service" or self.retriever_url is None
        rule(self, ok, "retriever", "'service' when env.retriever_url is set")
        local_ok = self.index == "bm25" or self.retriever == "service"  # a dense index is served, shared
        rule(self, local_ok, "index", "'bm25' with env.retriever = local (dense needs the service)")
        dense_ok = self.index != "dense" or self.encoder is not None
        return rule(self, dense_ok, "encoder", "a local encoder folder with env.index = dense")

    @model_validator(mode="after")
    def _harness_rules(self) -> Self:
        ok = self.harness is None or self.protocol == "qwen3"  # OpenAI tool calls ⇔ `<tool_call>` JSON
        rule(self, ok, "protocol", "'qwen3' with env.harness (tool calls as <tool_call> JSON)")
        token = self.agent_token or os.environ.get(AGENT_TOKEN_ENV)  # as the endpoint resolves it
        ok = self.harness is None or is_loopback(self.agent_host) or bool(token)
        why = f"a loopback address, or env.agent_token (or ${AGENT_TOKEN_ENV}) set: required off loopback"
        return rule(self, ok, "agent_host", why)

    @model_validator(mode="after")
    def _turn_fits_budget(self) -> Self:
        ok, budget = self.max_turn_tokens <= self.token_budget, self.token_budget
        rule(self, ok, "max_turn_tokens", f"an integer <= env.token_budget ({budget})")
        ok = self.think_tokens == 0 or self.name == "synthetic_kb"
        rule(self, ok, "think_tokens", "0 unless env.name = synthetic_kb (its warm start writes the spans)")
        room = self.think_tokens + 48  # the span, then a call of the tiny model's length
        ok = self.think_tokens == 0 or self.max_turn_tokens >= room
        return rule(self, ok, "max_turn_tokens", f">= env.think_tokens + 48 ({room}) with thinking")


class SamplerConfig(_Section):
    backend: Literal["hf", "vllm"] = "hf"
    num_samplers: PosInt = 2
    temperature: PosFloat = 1.0
    top_p: Annotated[Float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[NonNegInt, Field(description="0: off")] = 0
    prompts_per_request: PosInt = 1
    max_restarts: NonNegInt = 3
    # async: every episode (and branch) advances on its own over the backend's async engine (vLLM) or
    # gathered batches (HF); lockstep: one backend call per round of turns (docs/design.md §13)
    loop: Literal["async", "lockstep"] = "async"
    max_inflight_episodes: PosInt = 64  # episodes being sampled at once per sampler (async loop)
    # async loop: where tool calls run. threads: a pool of tool_threads (tools that may block: HTTP, a
    # large index); inline: on the event loop (fast in-process tools); auto: inline when the env says so
    tool_calls: Literal["auto", "inline", "threads"] = "auto"
    tool_threads: PosInt = 16
    # vLLM engine arguments (vLLM's names; defaults per platform: actors/policy/vllm_engine.py)
    engine: Annotated[
        dict[str, Any], AfterValidator(check_engine_args), Allowed("a mapping of vLLM engine arguments")
    ] = Field(default_factory=dict)
    unhealthy_grace_s: PosFloat = 180.0  # the run fails when no sampler has been healthy for this long


class LearnerConfig(_Section):
    batch_trees: PosInt = 8  # B: trees (prompts) per fixed rollout batch
    minibatches: PosInt = 4
    epochs: PosInt = 1
    lr: PosFloat = 3e-4
    warmup_steps: NonNegInt = 0  # learner steps of linear lr warmup from lr/warmup to lr (0: none)
    weight_decay: NonNegFloat = 0.0
    grad_clip: Annotated[NonNegFloat, Field(description="0 disables clipping")] = 1.0
    packed_forward: StrictBool = True
    checkpoint_every: PosInt = 1  # learner steps between checkpoints
    precision: Literal["float32", "bfloat16"] = "float32"  # bf16: autocast compute, fp32 master + AdamW
    grad_checkpointing: StrictBool = False  # recompute each decoder layer in backward (HF, non-reentrant)
    # Token budget of one forward/backward (0: one micro-batch per mini-batch); larger trees are split
    max_tokens_per_microbatch: NonNegInt = 0
    # LM-head rows computed at once when scoring loss tokens (0: all at once); 2048 rows × 151,936 vocab
    # is 1.2 GB of fp32 logits for Qwen3
    logprob_chunk_tokens: NonNegInt = 2048
    tree_attention: Literal["auto", "chunked", "flex"] = "auto"  # auto: flex on CUDA, chunked SDPA on CPU
    # Learner processes (FSDP2 shards, one placement-group bundle of resources.learner each); 1: one process
    ranks: PosInt = 1
    # A collective not joined by every rank within this fails the step, naming the lost rank (ranks > 1)
    collective_timeout_s: PosFloat = 300.0
    # π's temperature in the losses and the proximal pass; None: sampler.temperature (μ and π the same
    # distribution). Set apart only to force a known sampler/learner mismatch (configs/offpolicy_table.yaml)
    temperature: PosFloat | None = None
    # low-rank adapters (learner/lora.py; on any learner.ranks: learner/lora_sharded.py); rank 0: off
    lora: LoraConfig = Field(default_factory=LoraConfig)


class StoreConfig(_Section):
    dir: NonEmptyStr | None = None  # None: run_dir/store
    eta: Annotated[NonNegInt, Field(description="0: synchronous")] = 1  # max policy-version lag (AReaL's η)
    # staleness bounded by drift: admission lowers the lag it allows while the learner's measured turn KL
    # (correction/turn_kl) passes this bound (system/staleness.py drift_lag); None: by versions alone
    max_turn_kl: PosFloat | None = None


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
    log_every: PosInt = 1  # without a progress bar: a metrics line on stderr every this many steps
    # the learner's token log-probs, s_i and Z of every turn it trains, in RUN_DIR/learner_turns/ (what
    # `treeopsd view` shows as the student's p and the turn's loss; learner/turn_record.py)
    learner_turns: StrictBool = True
    # trackers beside tensorboard (storage/tracking.py), the same scalars and steps; off by default
    wandb: StrictBool = False
    wandb_project: NonEmptyStr = "treeopsd"
    mlflow: StrictBool = False
    mlflow_experiment: NonEmptyStr = "treeopsd"
    mlflow_uri: NonEmptyStr | None = None  # a tracking server's URL; None: RUN_DIR/mlruns (file store)


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

    @model_validator(mode="before")
    @classmethod
    def _resolve_offpolicy(cls, data: Any) -> Any:
        """`algo.proximal` / `algo.rollout_correction` = auto take their values for an off-policy or an
        on-policy run before the sections are checked (configs/algo.py `resolve_offpolicy`)."""
        return resolve_offpolicy(data)

    @model_validator(mode="after")
    def _recompute_needs_sync(self) -> Self:
        # Recomputed μ is θ_old at the learner; in async mode turns come from older versions (algorithm §11).
        ok = self.algo.behavior_logprobs != "recompute" or self.admission_eta == 0
        why = "'sampler' in async mode (recompute needs run.mode = sync or store.eta = 0)"
        return rule(self, ok, "algo.behavior_logprobs", why)

    @model_validator(mode="after")
    def _agent_ports_in_range(self) -> Self:
        # every sampler serves its own endpoint: sampler i binds env.agent_port + i (external/discovery.py)
        n, port = self.sampler.num_samplers, self.env.agent_port
        ok = self.env.harness is None or port == 0 or port + n - 1 <= 65535
        why = f"0 (a free port per sampler), or a port P with P + {n - 1} <= 65535 (sampler i binds P + i)"
        return rule(self, ok, "env.agent_port", why)

    @model_validator(mode="after")
    def _flex_needs_a_gpu(self) -> Self:
        # FlexAttention has no backward on the CPU (torch 2.13), and the learner is on the CPU without a GPU.
        ok = self.learner.tree_attention != "flex" or self.resources.learner.num_gpus > 0
        why = "'auto' or 'chunked' without a learner GPU (flex needs resources.learner.num_gpus > 0)"
        return rule(self, ok, "learner.tree_attention", why)

    @property
    def weights_dtype(self) -> str:
        """`weights.dtype` resolved: auto follows the learner's precision."""
        if self.weights.dtype != "auto":
            return self.weights.dtype
        return "bfloat16" if self.learner.precision == "bfloat16" else "float32"

    @property
    def store_dir(self) -> str:
        return self.store.dir or str(Path(self.run.run_dir) / "store")

    @property
    def admission_eta(self) -> int:
        """`store.eta`; in `run.mode = sync` (the synchronous baseline: the same topology) 0, or the lag the
        in-process samplers are held at (`run.sampler_lag`)."""
        return self.run.sampler_lag if self.run.mode == "sync" else self.store.eta


# ---- building configs from plain data ---------------------------------------------------------------------


def to_dict(cfg: BaseModel) -> dict[str, Any]:
    """Plain-data form (tuples as lists) for YAML/JSON and for shipping to actors."""
    return cfg.model_dump(mode="json")


# PyYAML raises its YAMLError, and ValueError or KeyError for some scalars (`2020-02-30`, `!!bool maybe`);
# UnicodeDecodeError (a ValueError) for a file that is not UTF-8
YAML_ERRORS = (yaml.YAMLError, ValueError, KeyError)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`key.sub=value` overrides, values parsed as YAML (`algo.rho=0.25`, `env.train_hops=[2,3]`)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        if not all(parts):  # "=1", "algo.=1", "algo..M=1": no key to name
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {p} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except YAML_ERRORS as e:
            problem = " ".join(str(e).split())  # one line
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem})") from None
    return data


def parse_config(data: dict[str, Any] | None, overrides: list[str] | None = None) -> Config:
    """Validates plain data (plus overrides) into a Config; the first problem, in field order, is raised."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    data = apply_overrides(copy.deepcopy(data or {}), list(overrides or []))
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(message(err.errors(include_url=False)[0], data, Config)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Loads a YAML file (default: the embedded configs/default.yaml) and applies overrides."""
    path = Path(path) if path else Path(__file__).with_name("default.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; pass a YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except YAML_ERRORS as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return parse_config(data, overrides)
