"""Per-turn progress labels for rollout trees of the synthetic KB: which turns moved the question forward.

    labels = progress_labels(tree, task, env, chat.decode_turn)   # bool per turn; labels[i - 1] is node i

The environment knows the gold chain E_0 --r_1--> E_1 --r_2--> ... --r_k--> E_k of every question
(`task.meta["chain"]`, `task.meta["path"]`); gold fact j is "The r_j of E_{j-1} is E_j." A turn is labelled:

- search turn: progress iff its observation states the *next* gold fact of the chain not yet found on its
  path (the lowest j whose fact no earlier observation on the path stated). A search that brings nothing
  new, a repeat (the same query returns the same facts), or one that finds only a later fact out of order is
  not progress. Every gold fact an observation states counts as found for the turns below it.
- answer turn: progress iff its answer is right (the environment's reward is 1).
- anything else (no call, a malformed or unknown call, an empty argument, a wrong answer): not progress.

The observation is replayed, not read back from the tree: each turn's text is decoded from its stored token
ids (only to parse it; nothing is re-tokenized) and passed to `env.step` with the calls made above it on
its path. The tools are pure functions of the call (actors/envs/base.py), so this is the observation the
sampler saw — and also the one a terminal search turn (cut at `env.max_turns` or at its token limit) got
back from the environment, which the tree does not store. Such a turn is labelled by the same rule.
Deterministic: the same tree gives the same labels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from actors.envs.base import FINISH_ANSWER, Environment, Task
from actors.envs.synthetic_kb import read_fact
from actors.envs.tool_calls import ToolCall
from system.tree import ROOT, RolloutTree

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class _PathState:
    """What the turns above a node did: the calls the env saw and the gold facts found so far."""

    calls: tuple[ToolCall, ...]
    found: frozenset[int]


def gold_facts_in(observation: str, chain: Sequence[str], path: Sequence[str]) -> set[int]:
    """Indices j (0-based: fact j links chain[j] to chain[j + 1]) of the gold facts `observation` states."""
    return {
        j
        for j, rel in enumerate(path)
        if read_fact(observation, chain[j], rel) == chain[j + 1]  # the exact sentence, right object
    }


def next_fact(found: frozenset[int], hops: int) -> int | None:
    """The lowest gold fact not found yet; None once every fact of the chain is found."""
    return next((j for j in range(hops) if j not in found), None)


def label_turn(env: Environment, task: Task, state: _PathState, text: str) -> tuple[bool, _PathState]:
    """(is this turn progress, the state its children start from)."""
    chain, path = task.meta["chain"], task.meta["path"]
    res = env.step(task, list(state.calls), text)
    calls = state.calls if res.call is None else (*state.calls, res.call)
    if res.done:  # an answer, or a turn with no call at all (both end the episode)
        right = res.info.get("finish") == FINISH_ANSWER and res.reward == 1.0
        return right, _PathState(calls, state.found)
    if res.call is None or res.call.name != "search" or "error" in res.info:
        return False, _PathState(calls, state.found)  # malformed / unknown / empty call: no search ran
    facts = gold_facts_in(res.observation or "", chain, path)
    nxt = next_fact(state.found, len(path))
    return nxt is not None and nxt in facts, _PathState(calls, state.found | facts)


def progress_labels(tree: RolloutTree, task: Task, env: Environment, decode: Decode) -> np.ndarray:
    """Progress label of every turn of `tree`, turn-indexed like `RolloutTree.turn_parents` (node i at
    index i − 1); `task` is the tree's question, `decode` turns stored ids into text (e.g.
    `ChatFormat.decode_turn`)."""
    if "chain" not in task.meta or "path" not in task.meta:
        raise ValueError(f"task {task.task_id}: progress labels need the synthetic KB's chain and path")
    if tree.prompt_id and tree.prompt_id != task.task_id:
        raise ValueError(f"tree {tree.tree_id} is for {tree.prompt_id}, not for task {task.task_id}")
    labels = np.zeros(len(tree.nodes) - 1, dtype=bool)
    states: dict[int, _PathState] = {ROOT: _PathState((), frozenset())}
    for node_id in tree.topological_order[1:]:  # parents first, so a parent's state is always ready
        node = tree.nodes[int(node_id)]
        text = decode([int(t) for t in node.tokens])
        labels[node.node_id - 1], states[node.node_id] = label_turn(env, task, states[node.parent], text)
    return labels
