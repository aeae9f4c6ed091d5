"""The sampler role: initialize–expand rollout trees (docs/algorithm.md §2) for admitted prompts, committed to
the store. Built from a config by `actors/sampler_setup.py:build_sampler`; a Ray actor is this class plus a
few methods (`actors/sampler_actor.py`).

    sampler = TreeSampler(backend, env, ChatFormat.from_tokenizer(tok), TreeShape(M=4, N=2), LoopLimits(),
                          weights=sink, store=store, tasks=tasks, rng=np.random.default_rng(0))
    sampler.sample_and_commit(4)                     # admission → 4 trees → store.put_raw
    trees = sampler.sample_trees(tasks, rng)         # the trees alone: one per task, K = M + branches

Phase 1 samples the M initial trajectories of every prompt together (one backend call per turn for all of
them); phase 2 picks N anchors per trajectory over its non-terminal boundaries and samples every branch
together. A branch starts from its anchor's exact stored context (`TreeBuilder.context_tokens`: prompt,
turns and observations, token ids as sampled) and the calls made so far: the tools are pure, so replaying
the calls restores the environment; nothing is re-executed or re-tokenized. Flat methods (GRPO/GSPO) are
the special case M = G, N = 0. New weights are applied between turns (`agent_loop.apply_new_weights`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actors.agent_loop import Episode, LoopLimits, apply_new_weights, run_episodes
from actors.chat import ChatFormat
from actors.envs.base import Environment, Task
from system.interfaces import StoreClient, WeightSink
from system.policy import PolicyBackend
from system.tree import RolloutTree
from system.tree_build import TreeBuilder, plan_anchors


@dataclass(frozen=True)
class TreeShape:
    M: int = 4
    N: int = 2
    anchor_shortfall: str = "skip"


class TreeSampler:
    def __init__(
        self,
        backend: PolicyBackend,
        env: Environment,
        chat: ChatFormat,
        shape: TreeShape,
        limits: LoopLimits,
        *,
        weights: WeightSink | None = None,
        store: StoreClient | None = None,
        tasks: Sequence[Task] = (),
        rng: np.random.Generator | None = None,
        prefix: str = "s0",
    ) -> None:
        self.backend, self.env, self.chat = backend, env, chat
        self.shape, self.limits, self.weights, self.store = shape, limits, weights, store
        self.tasks, self.rng = list(tasks), rng or np.random.default_rng(0)
        self.prefix, self.counter, self.dropped_trees = prefix, 0, 0
        self.started = time.perf_counter()
        self.stats: dict[str, float] = {"sampler/trees": 0.0, "sampler/tokens": 0.0, "sampler/busy_s": 0.0}
        self.stats["sampler/wait_for_weights_s"] = 0.0

    def version(self) -> int:
        """The policy version of the weights in the backend (a method: callable on the Ray actor too)."""
        return int(self.backend.version)

    # ---- the role ----------------------------------------------------------------------------------
    def sample_and_commit(self, n: int, min_version: int = 0, wait_s: float = 60.0) -> dict[str, Any]:
        """Samples up to n admitted trees (once the weights reach `min_version`: the synchronous mode) and
        commits them to the store; unused reservations go back. Returns counts and the metrics snapshot."""
        if self.store is None:
            raise RuntimeError("sample_and_commit needs a store (TreeSampler(..., store=...))")
        self._wait_for_version(min_version, wait_s)
        granted = self.store.admit(n)
        if granted == 0:  # the learner is η versions behind: the caller backs off
            return {"admitted": 0.0, "trees": 0.0, "metrics": self.get_metrics()}
        try:
            trees = self.sample(granted)
            if trees:
                self.store.put_raw(trees)
        except BaseException:
            self.store.release(granted)  # give the reservation back before failing
            raise
        if granted > len(trees):
            self.store.release(granted - len(trees))  # trees dropped by on_verifier_error=drop_tree
        lag = max((self.version() - min(t.versions) for t in trees), default=0)
        out = {"admitted": float(granted), "trees": float(len(trees)), "lag": float(lag)}
        return {**out, "metrics": self.get_metrics()}  # metrics ride along: no extra (blocking) call

    def _wait_for_version(self, min_version: int, wait_s: float) -> None:
        t0 = time.perf_counter()
        apply_new_weights(self.backend, self.weights, self.stats)  # an idle sampler catches up here too
        while self.version() < min_version and time.perf_counter() - t0 < wait_s:
            if self.weights is not None and (got := self.weights.poll(100)) is not None:
                self.backend.load_weights(got[1], version=got[0])
        self.stats["sampler/wait_for_weights_s"] += time.perf_counter() - t0

    def sample(self, n: int) -> list[RolloutTree]:
        """n prompts drawn uniformly from the training split → n trees (fewer if dropped by policy)."""
        picks = self.rng.integers(len(self.tasks), size=n)
        ids = [f"{self.prefix}-{self.counter + j:06d}" for j in range(n)]
        self.counter += n
        t0 = time.perf_counter()
        trees = self.sample_trees([self.tasks[int(i)] for i in picks], self.rng, ids)
        busy = time.perf_counter() - t0
        tokens = sum(sum(len(x.tokens) for x in t.nodes) for t in trees)
        self.stats["sampler/trees"] += len(trees)
        self.stats["sampler/tokens"] += tokens
        self.stats["sampler/busy_s"] += busy
        self.stats["sampler/tokens_per_s"] = tokens / max(busy, 1e-9)
        self.stats["sampler/dropped_trees"] = float(self.dropped_trees)
        return trees

    def get_metrics(self) -> dict[str, float]:
        stats = dict(self.stats)
        stats.update(getattr(self.env, "metrics", dict)())  # e.g. env/retrieval_errors (a retrieval service)
        stats["sampler/version"] = float(self.version())
        elapsed = time.perf_counter() - self.started
        stats["sampler/idle_ratio"] = max(0.0, 1.0 - stats["sampler/busy_s"] / max(elapsed, 1e-9))
        return stats

    # ---- initialize–expand -------------------------------------------------------------------------
    def sample_trees(
        self, tasks: Sequence[Task], rng: np.random.Generator, tree_ids: Sequence[str] | None = None
    ) -> list[RolloutTree]:
        """Trees for `tasks` (a tree that ends with a verifier error under `drop_tree` is left out)."""
        ids = (
            list(tree_ids)
            if tree_ids is not None
            else [f"{t.task_id}-{rng.integers(1 << 62):x}" for t in tasks]
        )
        builders = [self._builder(t, i) for t, i in zip(tasks, ids, strict=True)]
        trunks = [
            [self._episode(t, b, f"{b.tree_id}/m{m}") for m in range(self.shape.M)]
            for t, b in zip(tasks, builders, strict=True)
        ]
        self._run([e for group in trunks for e in group])
        branches = []
        for task, b, group in zip(tasks, builders, trunks, strict=True):
            counts = [len(e.nodes) for e in group]
            for j, (m, k) in enumerate(plan_anchors(counts, self.shape.N, rng, self.shape.anchor_shortfall)):
                branches.append(self._branch(task, b, group[m], k, j))
        self._run(branches)
        if hasattr(self.backend, "evict"):  # free the per-episode KV caches (HF backend)
            self.backend.evict(*(e.key for group in trunks for e in group), *(e.key for e in branches))
        for task, group in zip(tasks, trunks, strict=True):
            if not any(e.nodes for e in group):
                raise ValueError(f"task {task.task_id}: the prompt alone exceeds the token budget")
        trees = [self._finish(b, group, branches) for b, group in zip(builders, trunks, strict=True)]
        return [t for t in trees if t is not None]

    def _finish(self, b: TreeBuilder, group: list[Episode], branches: list[Episode]) -> RolloutTree | None:
        eps = [*group, *(e for e in branches if e.builder is b)]
        if any(e.verifier_failed for e in eps) and self.limits.on_verifier_error == "drop_tree":
            self.dropped_trees += 1
            return None
        b.meta["finish"] = json.dumps({str(e.nodes[-1]): e.finish for e in eps if e.nodes})
        return b.build()

    def _run(self, episodes: list[Episode]) -> None:
        run_episodes(episodes, self.backend, self.env, self.chat, self.limits, self.weights, self.stats)

    def _builder(self, task: Task, tree_id: str) -> TreeBuilder:
        prompt = self.chat.initial_context(self.env.system_prompt(), self.env.user_prompt(task))
        meta = {"task_id": task.task_id, "dataset": task.dataset, "answers": json.dumps(list(task.answers))}
        return TreeBuilder(tree_id, prompt, prompt_id=task.task_id, meta=meta)

    def _episode(self, task: Task, b: TreeBuilder, key: str) -> Episode:
        return Episode(task, b, parent=0, context=b.context_tokens(0), calls=[], turns_done=0, key=key)

    def _branch(self, task: Task, b: TreeBuilder, trunk: Episode, k: int, j: int) -> Episode:
        """A fresh suffix from boundary k of `trunk`: under its k-th turn, after that turn's observation."""
        anchor = trunk.nodes[k - 1]
        return Episode(
            task,
            b,
            parent=anchor,
            context=b.context_tokens(anchor),
            calls=list(trunk.calls[:k]),
            turns_done=k,
            key=f"{b.tree_id}/b{j}",
            parent_key=trunk.key,  # the backend crops the trunk's cache to the shared prefix
        )

    def close(self) -> None:
        self.backend.close()
