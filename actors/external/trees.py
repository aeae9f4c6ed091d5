"""Trees from outside: initialize–expand over a user's harness, driven through the agent endpoint.

    ext = ExternalTrees(load_harness("examples.search_agent:run_episode"), AgentEndpoint(), templates, ...)
    sampler = TreeSampler(..., external=ext)          # sample_trees → ext.grow: admission, commit as before

The harness is a plain function `run_episode(task: dict, base_url: str, session: str) -> reward | None`
that talks to `base_url` with any OpenAI client, with the session's key (`task["api_key"]`). Per tree: M
runs of the harness on the task (the trunks, each its own session: episodes.py); each trunk's *line* (the
calls its episode runs in: its conversations and compactions, and the summary or sub-agent calls that fed
them, line.py) becomes a chain of the tree, with a restart wherever a call's context does not extend the
previous one's; then N anchors per trunk over its line's call boundaries (`plan_anchors`, as the own
loop), and per anchor k a new run of the harness on the same task whose calls before the trunk's k-th line
call are answered from the trunk's record, whatever conversation they are in (prefix forcing: replay.py),
each checked against it token for token; from the anchor on it samples fresh and hangs under the trunk's
node. A branch whose context differs (a non-deterministic harness) is refused (409), counted
(`external/branches_refused`) and never stored. Only whole, rewarded episodes enter the tree (a tree whose
trunks all fail is dropped).

Side calls (the conversations outside a line: side.py) are returned as trees of their own, linked to the
episode tree, as `env.side_calls` says (`train`: those that carry signal); the tree's meta `calls` logs every
call of its episodes with its conversation and parent call.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from actors.async_loop import gather_or_cancel
from actors.envs.base import Task
from actors.envs.tool_calls import ToolCall
from actors.external.discovery import Discovery
from actors.external.endpoint import AgentEndpoint
from actors.external.episodes import TreePlan, run_episode
from actors.external.health import HarnessHealth
from actors.external.line import add_line, main_chain, side_conversations
from actors.external.openai_format import SamplingBounds
from actors.external.render import Templates
from actors.external.replay import PrefixReplay, RecordedCall
from actors.external.session import Round, Session, count
from actors.external.side import calls_meta, side_trees
from actors.tree_sampler import Grown
from actors.weight_gate import WeightGate
from system.policy import TurnServer
from system.tree import ROOT, RolloutTree
from system.tree_build import TreeBuilder, plan_anchors

if TYPE_CHECKING:
    from actors.tree_sampler import TreeSampler

Harness = Callable[[dict[str, Any], str, str], Any]


def load_harness(spec: str) -> Harness:
    """`module:function` → the function (errors name `env.harness`). The module is looked up from the
    working directory too, as `uvicorn module:app` does (a console script's sys.path lacks it)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"env.harness = {spec!r}: expected 'module:function'")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"env.harness = {spec!r}: cannot import {module}: {exc}") from exc
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"env.harness = {spec!r}: {module} has no function {name}")
    return fn  # type: ignore[no-any-return]


@dataclass(frozen=True)
class HarnessLimits:
    timeout_s: float = 120.0  # env.harness_timeout_s: one run of the harness, start to return
    reward_timeout_s: float = 10.0  # env.reward_timeout_s: after a run that returned None
    max_failures: int = 32  # env.harness_max_failures: trunks dropped in a row that stop the run


class ExternalTrees:
    """The tree source of a TreeSampler whose episodes come from a harness (`env.harness`)."""

    def __init__(
        self,
        harness: Harness,
        endpoint: AgentEndpoint,
        templates: Templates,
        bounds: SamplingBounds,
        limits: HarnessLimits = HarnessLimits(),
        name: str | None = None,
        side_calls: str = "train",
        tool_change: str = "refuse",
        index: int = 0,
    ) -> None:
        self.harness, self.endpoint, self.templates = harness, endpoint, templates
        self.bounds, self.limits, self.side_calls, self.tool_change = bounds, limits, side_calls, tool_change
        name = name or f"{getattr(harness, '__module__', '?')}:{getattr(harness, '__qualname__', harness)}"
        self.health = HarnessHealth(name, limits.max_failures)
        self.index = index  # the sampler's (its logs/sampler-<i>.log): the run names it (external_tally.py)
        self.stats: dict[str, float] = {}  # external/*: counted since the start, joined to the sampler's
        self.discovery: Discovery | None = None  # its entry in RUN_DIR/agent_endpoints.json, if listed

    def grow(
        self, sampler: TreeSampler, tasks: Sequence[Task], rng: np.random.Generator, ids: Sequence[str]
    ) -> Grown:
        seeds = rng.integers(1 << 62, size=len(tasks))
        plans = [
            TreePlan(t, i, np.random.default_rng(int(s))) for t, i, s in zip(tasks, ids, seeds, strict=True)
        ]
        for p in plans:
            p.trunks = [Session(f"{p.tree_id}/m{m}", p.state, _seed(p)) for m in range(sampler.shape.M)]

        def episodes(server: TurnServer, gate: WeightGate) -> Any:
            rnd = Round(
                server,
                gate,
                self.templates,
                sampler.limits,
                self.bounds,
                self.stats,
                tool_change=self.tool_change,
            )
            return _grow_all(self, rnd, plans, sampler)

        sampler.run_round(episodes)
        trees = [_finish(p) for p in plans]
        side: list[RolloutTree] = []
        for p in plans:
            convs = [(s, c) for s in p.stored for c in side_conversations(s)]
            kept, skipped = side_trees(
                p.tree_id, _meta(p), convs, sampler.limits.mask_truncated_turn, self.side_calls
            )
            side += kept
            count(self.stats, "external/side_trees_skipped", skipped)
        count(self.stats, "external/side_trees", len(side))
        return Grown([t for t in trees if t is not None] + side, dropped=sum(t is None for t in trees))

    def metrics(self) -> dict[str, float]:
        """What the sampler's metrics add (TreeSampler.get_metrics), whether or not a round finished."""
        return {
            **self.stats,
            **self.endpoint.metrics(),  # rejected before any session, refusals by reason: since the start
            "external/failures_in_row": float(self.health.in_row),
            "external/sampler_index": float(self.index),
        }

    def task_view(self, sampler: TreeSampler, task: Task, session: str) -> dict[str, Any]:
        """What the harness gets: the question and answers, the env's system prompt and tools, a function
        running one tool call (`call_tool(name, arguments) -> text`), the session's api key (it names the
        session: `base_url` and it suffice), the base URL that names the session by itself (`session_url`)."""
        env = sampler.env
        return {
            "task_id": task.task_id,
            "question": task.question,
            "answers": list(task.answers),
            "dataset": task.dataset,
            "meta": dict(task.meta),
            "system_prompt": env.system_prompt(),
            "tools": list(getattr(env, "tool_schemas", list)()),
            "call_tool": functools.partial(call_tool, env, task),
            "api_key": self.endpoint.session_key(session),  # names the session: base_url + api_key suffice
            "session_url": self.endpoint.session_url(session),
        }

    def close(self) -> None:
        if self.discovery is not None:
            self.discovery.withdraw()
        self.endpoint.close()


def call_tool(env: Any, task: Task, name: str, arguments: dict[str, Any]) -> str:
    """One tool call of the task's environment (pure tools: replays give the same text)."""
    inner = getattr(env, "env", env)  # under a protocol (ProtocolEnv): the environment itself
    result = inner.step_parsed(task, [], ToolCall(name, dict(arguments)))
    return str(result.observation) if result.observation is not None else ""


def _seed(p: TreePlan) -> int:
    return int(p.rng.integers(1 << 62))


# Module functions, not methods: a class with an `async def` method becomes an asyncio actor in Ray.
async def _grow_all(ext: ExternalTrees, rnd: Round, plans: list[TreePlan], sampler: TreeSampler) -> None:
    slots = asyncio.Semaphore(sampler.max_inflight)
    ext.endpoint.attach(rnd, asyncio.get_running_loop())
    try:
        await gather_or_cancel(*(_grow(ext, rnd, slots, p, sampler) for p in plans))
    finally:
        ext.endpoint.detach()


async def _grow(
    ext: ExternalTrees, rnd: Round, slots: asyncio.Semaphore, p: TreePlan, sampler: TreeSampler
) -> None:
    """One tree: its M trunks, then (committed first) its branches, then its caches freed."""
    episode = functools.partial(run_episode, ext, rnd, slots, p, sampler)
    await gather_or_cancel(*(episode(s) for s in p.trunks))
    ok = [s for s in p.trunks if s.failure is None]
    if ok:
        _commit_trunks(p, ok, rnd)
        shape = sampler.shape
        anchors = plan_anchors([len(s.line) for s in ok], shape.N, p.rng, shape.anchor_shortfall)
        branches = [_branch(p, ok[m], k, j) for j, (m, k) in enumerate(anchors)]
        count(rnd.stats, "external/branches", len(branches))
        await gather_or_cancel(*(episode(b) for b, _ in branches))
        for b, anchor in branches:
            if b.failure is None:
                _commit(p, b, [c for c in b.line if c >= b.start] or [b.start], anchor, rnd)
            elif b.failure.startswith("context mismatch"):
                count(rnd.stats, "external/branches_refused")
    sessions = [rnd.sessions[k] for k in p.keys]
    sampled = [(s, i) for s in sessions for i, c in enumerate(s.calls) if not c.replayed]
    count(rnd.stats, "external/side_calls", sum(i not in s.line for s, i in sampled))
    await rnd.server.release(*(c.key for s in sessions for c in s.convs))


def _branch(p: TreePlan, trunk: Session, k: int, j: int) -> tuple[Session, int]:
    """A new run of the harness whose calls before the trunk's k-th line call replay the trunk's, under the
    trunk's node of its (k-1)-th line call."""
    record = [RecordedCall(c.context, _turn_of(trunk, i)) for i, c in enumerate(trunk.calls)]
    replay = PrefixReplay(record, upto=trunk.line[k])
    caches = {c.index: c.key for c in trunk.convs}
    s = Session(f"{p.tree_id}/b{j}", p.state, _seed(p), replay=replay, trunk_keys=caches)
    return s, trunk.nodes[trunk.line[k - 1]]


def _turn_of(s: Session, call: int) -> Any:
    conv = s.convs[s.calls[call].conv]
    return conv.turns[conv.calls.index(call)]


def _commit_trunks(p: TreePlan, trunks: list[Session], rnd: Round) -> None:
    assert p.state.prompt is not None
    p.builder = TreeBuilder(p.tree_id, p.state.prompt.ids, prompt_id=p.task.task_id, meta=_meta(p))
    for s in trunks:
        _commit(p, s, s.line, ROOT, rnd)


def _meta(p: TreePlan) -> dict[str, str]:
    answers = json.dumps(list(p.task.answers))
    return {"task_id": p.task.task_id, "dataset": p.task.dataset, "answers": answers, "source": "external"}


def _commit(p: TreePlan, s: Session, calls: list[int], parent: int, rnd: Round) -> None:
    """The session's own line calls (a branch's from its anchor on) into the tree, under `parent`."""
    assert p.builder is not None and s.reward is not None
    leaf = add_line(p.builder, s, sorted(calls), parent, rnd.limits.mask_truncated_turn)
    p.builder.set_reward(leaf, s.reward)
    p.finish[leaf] = s.finish or "done"
    p.stored.append(s)
    count(rnd.stats, "external/episodes_stored")
    chain = main_chain(s)
    if s.replay is not None:  # a branch: its anchor (the first call it sampled), and where that call was
        conv = s.calls[s.start].conv
        context = chain.index(conv) if conv in chain else -1  # 0: before any compaction; -1: a fed call
        p.anchors[s.key] = {"call": s.start, "conversation": conv, "context": context}
    count(rnd.stats, "external/compactions", sum(s.convs[c].first_call >= s.start for c in chain[1:]))
    count(
        rnd.stats,
        "external/line_side_calls",
        sum(c >= s.start and s.calls[c].conv not in chain for c in calls),
    )


def _finish(p: TreePlan) -> RolloutTree | None:
    if p.builder is None:
        return None
    p.builder.meta["finish"] = json.dumps({str(k): v for k, v in sorted(p.finish.items())})
    p.builder.meta["calls"] = calls_meta(p.stored)  # every call of its episodes: [conversation, parent call]
    p.builder.meta["anchors"] = json.dumps(p.anchors)  # per branch: its anchor's call, conversation, context
    return p.builder.build()
