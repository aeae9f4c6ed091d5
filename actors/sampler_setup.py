"""Building the sampler's parts from a Config: environment, task splits, policy backend, loop limits
(`sampler_parts`: TreeSampler's constructor arguments). The role itself is built by runtime/builder.py's
`make_sampler`, for both wirings; the role's work is in actors/tree_sampler.py.

    parts = sampler_parts(cfg, model_path, index=0)          # backend, env, tasks, limits, RNG, ...
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from actors.agent_loop import LoopLimits
from actors.envs.base import Environment, Task
from actors.failures import explain
from actors.protocols import bind_protocol
from actors.tree_sampler import TreeShape
from configs.schema import Config
from storage.role_log import role_log_path
from system.policy import PolicyBackend, SamplingConfig

logger = logging.getLogger(__name__)


def build_env(cfg: Config) -> Environment:
    """The configured environment (the synthetic KB by default). With `env.retriever = service` its search
    tool asks the shared retrieval service (`actors/envs/retrieval_client.py`) instead of an own index."""
    from actors.envs import make_env
    from actors.envs.retrieval_client import service_client

    e = cfg.env
    if e.name == "gym":  # an outside environment (actors/envs/gym): its factory, pool and replay
        from actors.envs.gym import build_gym_env

        return build_gym_env(e)
    index = service_client(e)  # None: the environment builds its in-process BM25 index
    if e.name == "synthetic_kb":
        from actors.envs.synthetic_kb import KBConfig
        from actors.envs.thinking import chunks_for

        kb, think = KBConfig(seed=e.seed), chunks_for(e.think_tokens)
        return make_env(
            e.name, config=kb, topk=e.topk, max_turns=e.max_turns, index=index, think_chunks=think
        )
    if e.name == "multihop_qa" and index is not None:  # the corpus lives in the service
        return make_env(e.name, corpus_index=index, topk=e.topk, max_turns=e.max_turns)
    if e.corpus is None:
        raise ValueError(f"env.corpus must name a local corpus file for env.name={e.name}")
    extra = {} if index is None else {"index": index}  # deep_research keeps its documents for `open`
    return make_env(e.name, corpus=e.corpus, topk=e.topk, max_turns=e.max_turns, **extra)


def load_split(cfg: Config, split: str, env: Environment | None = None) -> list[Task]:
    """Training or evaluation tasks. Synthetic KB: train on `env.train_hops`, evaluate on `env.eval_hops`
    (`env.eval_per_hop` questions each, from `env.eval_split`: the eval or the validation split)."""
    from actors.envs import load_tasks

    e = cfg.env
    if e.name == "gym":  # the ecosystem's own tasks (a verifiers taskset), or the rows of env.data
        path = e.data if split == "train" else (e.eval_data or e.data)
        return list((env if env is not None else build_env(cfg)).tasks(path))  # type: ignore[attr-defined]
    if e.name == "synthetic_kb":
        from actors.envs.synthetic_kb import KBConfig

        if split == "train":
            return load_tasks(e.name, "train", config=KBConfig(seed=e.seed), hops=e.train_hops)
        hops = tuple(range(e.eval_hops[0], e.eval_hops[1] + 1))
        kb = KBConfig(seed=e.seed)  # eval_split "val": the validation split, disjoint from eval and train
        return load_tasks(e.name, e.eval_split, config=kb, hops=hops, per_hop=e.eval_per_hop)
    path = e.data if split == "train" else (e.eval_data or e.data)
    if path is None:
        raise ValueError(f"env.data must name a local dataset file for env.name={e.name}")
    return load_tasks(e.name, split, path=path)


def build_backend(
    cfg: Config, model_path: str, greedy: bool = False, seed: int | None = None
) -> PolicyBackend:
    sampling = SamplingConfig.of(cfg.sampler, greedy, seed)
    if cfg.sampler.backend == "vllm":
        from actors.policy.vllm_backend import VLLMBackend
        from system.lora_sync import samplers_load_adapters

        # dtype: sampler.engine's if set, else bf16 on a GPU and model.dtype on the CPU (vllm_engine.py)
        return VLLMBackend(
            model_path,
            sampling=sampling,
            seed=seed,
            cpu_dtype=cfg.model.dtype,
            extra_engine_args=cfg.sampler.engine,
            apply_timeout_s=cfg.weights.apply_timeout_s,
            lora_rank=cfg.learner.lora.rank if samplers_load_adapters(cfg) else 0,  # adapters, not merged
        )
    from actors.policy.hf_backend import HFBackend

    return HFBackend(model_path, threads=cfg.model.threads, sampling=sampling)


def loop_limits(cfg: Config) -> LoopLimits:
    return LoopLimits(
        max_turns=cfg.env.max_turns,
        max_turn_tokens=cfg.env.max_turn_tokens,
        token_budget=cfg.env.token_budget,
        mask_truncated_turn=cfg.algo.mask_truncated_turn,
        on_verifier_error=cfg.algo.on_verifier_error,
    )


def tree_shape(cfg: Config) -> TreeShape:
    a = cfg.algo
    return (
        TreeShape(M=a.M, N=a.N, anchor_shortfall=a.anchor_shortfall)
        if a.is_tree_method
        else TreeShape(a.G, 0)
    )


def sampler_seed(cfg: Config, index: int, incarnation: int = 0) -> int:
    """Each sampler (and each restart of it) gets its own stream; engines (vLLM) need a seed below 2**31."""
    return (cfg.run.seed * 1000 + index * 17 + incarnation * 7919) % (2**31 - 1)


def sampler_parts(
    cfg: Config, model_path: str, index: int = 0, incarnation: int = 0, backend: PolicyBackend | None = None
) -> dict[str, Any]:
    """`TreeSampler`'s constructor arguments from the config: backend (unless given), environment (under
    the agent protocol), training split, protocol (`chat`), limits, loop, its own RNG stream and tree-id
    prefix. A failure is raised as a SamplerFailure naming its root cause, the config key to blame (a chat
    template, a corpus, a model path) and the role's log file (actors/failures.py)."""
    seed = sampler_seed(cfg, index, incarnation)
    own_backend = backend is None
    try:
        backend = backend or build_backend(cfg, model_path, seed=seed)
        tokenizer = getattr(backend, "tokenizer", None) or load_tokenizer(model_path)
        chat, env = bind_protocol(cfg.env, tokenizer, build_env(cfg))  # env.protocol: how calls are written
        tasks = load_split(cfg, "train", env)
        external = external_trees(cfg, chat, index) if cfg.env.harness else None  # env.harness: your agent
    except Exception as exc:
        if own_backend and backend is not None:
            backend.close()  # vLLM: its engine core and workers go too
        log = role_log_path(cfg.run.run_dir, "sampler", index)
        failure = explain(exc, cfg, model_path, str(log) if log.exists() else None)
        logger.exception("sampler %d cannot start: %s", index, failure)  # the traceback, in the role's log
        raise failure from exc
    return {
        "backend": backend,
        "env": env,
        "chat": chat,
        "shape": tree_shape(cfg),
        "limits": loop_limits(cfg),
        "tasks": tasks,
        "rng": np.random.default_rng(seed),
        "prefix": f"s{index}i{incarnation}",
        "loop": cfg.sampler.loop,  # async: episodes advance on their own (actors/async_loop.py)
        "max_inflight": cfg.sampler.max_inflight_episodes,
        "tool_calls": cfg.sampler.tool_calls,
        "tool_threads": cfg.sampler.tool_threads,
        "external": external,
    }


def external_trees(cfg: Config, protocol: Any, index: int = 0) -> Any:
    """The tree source for `env.harness`: the harness, and the endpoint it talks to (bound here: a fixed
    env.agent_port P is P + index), listed in RUN_DIR/agent_endpoints.json (actors/external/discovery.py)."""
    from actors.external.discovery import Discovery, reachable_url, sampler_port
    from actors.external.endpoint import AgentEndpoint
    from actors.external.openai_format import SamplingBounds
    from actors.external.render import Templates
    from actors.external.trees import ExternalTrees, HarnessLimits, load_harness

    e = cfg.env
    harness = load_harness(str(e.harness))
    port = sampler_port(e.agent_port, index)
    endpoint = AgentEndpoint(
        e.agent_host, port, e.agent_token, wait_s=e.harness_timeout_s, agent_wait_s=e.agent_wait_s
    )
    bounds = SamplingBounds(cfg.sampler.temperature, cfg.sampler.top_p)
    limits = HarnessLimits(e.harness_timeout_s, e.reward_timeout_s, e.harness_max_failures)
    templates = Templates(protocol)
    ext = ExternalTrees(
        harness, endpoint, templates, bounds, limits, str(e.harness), e.side_calls, e.tool_change, index
    )
    ext.discovery = Discovery(cfg.run.run_dir, index)  # withdrawn when the sampler closes
    ext.discovery.publish(reachable_url(endpoint.url, e.agent_host))
    return ext


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
