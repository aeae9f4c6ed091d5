"""The sampler role without Ray: builds backend, environment and tree sampler from a Config and turns
prompts into rollout trees. `actors/sampler_actor.py` wraps it for Ray; tests and `local_run` use it as is.

    worker = SamplerWorker(cfg, model_path, sampler_index=0)
    trees = worker.sample(4)                         # 4 prompts → 4 trees, K = M + completed branches
    worker.apply_weights(named_arrays, version=3)    # between turns, via the weight subscriber hook
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from actors.agent_loop import LoopLimits
from actors.chat import ChatFormat
from actors.envs.base import Task
from actors.tree_sampler import TreeSampler, TreeShape
from configs.schema import Config
from system.policy import PolicyBackend, SamplingConfig
from system.tree import RolloutTree

log = logging.getLogger(__name__)


def build_env(cfg: Config):
    """The configured environment (the synthetic KB by default)."""
    from actors.envs import make_env

    e = cfg.env
    if e.name == "synthetic_kb":
        from actors.envs.synthetic_kb import KBConfig

        return make_env(e.name, config=KBConfig(seed=e.seed), topk=e.topk, max_turns=e.max_turns)
    if e.corpus is None:
        raise ValueError(f"env.corpus must name a local corpus file for env.name={e.name}")
    return make_env(e.name, corpus=e.corpus, topk=e.topk, max_turns=e.max_turns)


def load_split(cfg: Config, split: str, env=None) -> list[Task]:
    """Training or evaluation tasks. Synthetic KB: train on `env.train_hops`, evaluate on `env.eval_hops`."""
    from actors.envs import load_tasks

    e = cfg.env
    if e.name == "synthetic_kb":
        from actors.envs.synthetic_kb import KBConfig

        if split == "train":
            return load_tasks(e.name, "train", config=KBConfig(seed=e.seed), hops=e.train_hops)
        hops = tuple(range(e.eval_hops[0], e.eval_hops[1] + 1))
        return load_tasks(e.name, "eval", config=KBConfig(seed=e.seed), hops=hops)
    path = e.data if split == "train" else (e.eval_data or e.data)
    if path is None:
        raise ValueError(f"env.data must name a local dataset file for env.name={e.name}")
    return load_tasks(e.name, split, path=path)


def build_backend(
    cfg: Config, model_path: str, greedy: bool = False, seed: int | None = None
) -> PolicyBackend:
    temperature = 0.0 if greedy else cfg.sampler.temperature
    sampling = SamplingConfig(temperature=temperature, top_p=cfg.sampler.top_p, seed=seed)
    if cfg.sampler.backend == "vllm":
        from actors.policy.vllm_backend import VLLMBackend

        return VLLMBackend(model_path, sampling=sampling, dtype=cfg.model.dtype, seed=seed)
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


class SamplerWorker:
    def __init__(
        self,
        cfg: Config,
        model_path: str,
        sampler_index: int = 0,
        incarnation: int = 0,
        backend: PolicyBackend | None = None,
    ) -> None:
        self.cfg, self.index = cfg, sampler_index
        # a restart gets a fresh stream; engines (vLLM) need a seed below 2**32
        seed = (cfg.run.seed * 1000 + sampler_index * 17 + incarnation * 7919) % (2**31 - 1)
        self.rng = np.random.default_rng(seed)
        self.backend = backend or build_backend(cfg, model_path, seed=seed)
        self.env = build_env(cfg)
        self.tasks = load_split(cfg, "train", self.env)
        tokenizer = getattr(self.backend, "tokenizer", None) or _load_tokenizer(model_path)
        self.chat = ChatFormat.from_tokenizer(tokenizer)
        self.weight_hook: Callable[[], None] | None = None
        self.sampler = TreeSampler(
            self.backend, self.env, self.chat, tree_shape(cfg), loop_limits(cfg), self._between_turns
        )
        self.prefix = f"s{sampler_index}i{incarnation}"
        self.counter = 0
        self.stats: dict[str, float] = {"sampler/trees": 0.0, "sampler/tokens": 0.0, "sampler/busy_s": 0.0}

    def _between_turns(self) -> None:
        if self.weight_hook is not None:
            self.weight_hook()

    @property
    def version(self) -> int:
        return int(self.backend.version)

    def apply_weights(self, named: dict[str, Any], version: int) -> None:
        if version > self.version:
            t0 = time.perf_counter()
            self.backend.load_weights(named, version)  # in place: no engine restart
            self.stats["weights/apply_s"] = time.perf_counter() - t0

    def sample(self, n: int) -> list[RolloutTree]:
        """n prompts drawn uniformly from the training split → n trees (fewer if dropped by policy)."""
        picks = self.rng.integers(len(self.tasks), size=n)
        tasks = [self.tasks[int(i)] for i in picks]
        ids = [f"{self.prefix}-{self.counter + j:06d}" for j in range(n)]
        self.counter += n
        t0 = time.perf_counter()
        trees = self.sampler.sample_trees(tasks, self.rng, ids)
        busy = time.perf_counter() - t0
        tokens = sum(sum(len(x.tokens) for x in t.nodes) for t in trees)
        self.stats["sampler/trees"] += len(trees)
        self.stats["sampler/tokens"] += tokens
        self.stats["sampler/busy_s"] += busy
        self.stats["sampler/tokens_per_s"] = tokens / max(busy, 1e-9)
        self.stats["sampler/dropped_trees"] = float(self.sampler.dropped_trees)
        return trees

    def close(self) -> None:
        self.backend.close()


def _load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
