"""Initialize–expand rollout trees (algorithm.md §2) for a batch of prompts, on any policy backend.

    sampler = TreeSampler(backend, env, ChatFormat.from_tokenizer(tok), TreeShape(M=4, N=2), LoopLimits())
    trees = sampler.sample_trees(tasks, rng)          # one RolloutTree per task, K = M + completed branches

Phase 1 samples the M initial trajectories of every prompt together (one backend call per turn for all
of them); phase 2 picks N anchors per trajectory over its non-terminal boundaries and samples every branch
together. A branch starts from its anchor's exact stored context (`TreeBuilder.context_tokens`: prompt,
turns and observations, token ids as sampled) and the calls made so far: the tools are pure, so replaying
the calls restores the environment; nothing is re-executed or re-tokenized. Flat methods (GRPO/GSPO) are
the special case M = G, N = 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from actors.agent_loop import Episode, LoopLimits, run_episodes
from actors.chat import ChatFormat
from actors.envs.base import Environment, Task
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
        between_turns: Callable[[], None] | None = None,
    ) -> None:
        self.backend, self.env, self.chat = backend, env, chat
        self.shape, self.limits, self.between_turns = shape, limits, between_turns
        self.dropped_trees = 0

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
        trees = []
        for task, group in zip(tasks, trunks, strict=True):
            if not any(e.nodes for e in group):
                raise ValueError(f"task {task.task_id}: the prompt alone exceeds the token budget")
        for b, group in zip(builders, trunks, strict=True):
            eps = [*group, *(e for e in branches if e.builder is b)]
            if any(e.verifier_failed for e in eps) and self.limits.on_verifier_error == "drop_tree":
                self.dropped_trees += 1
                continue
            b.meta["finish"] = json.dumps({str(e.nodes[-1]): e.finish for e in eps if e.nodes})
            trees.append(b.build())
        return trees

    def _run(self, episodes: list[Episode]) -> None:
        run_episodes(episodes, self.backend, self.env, self.chat, self.limits, self.between_turns)

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
