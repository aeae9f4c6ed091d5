"""Trees from outside: initialize–expand over a user's harness, driven through the agent endpoint.

    ext = ExternalTrees(load_harness("examples.search_agent:run_episode"), AgentEndpoint(), templates, ...)
    sampler = TreeSampler(..., external=ext)          # sample_trees → ext.grow: admission, commit as before

The harness is a plain function `run_episode(task: dict, base_url: str, session: str) -> reward | None`
that talks to `base_url` with any OpenAI client, naming `session` (header `X-Session-Id` or `user`). Per
tree: M runs of the harness on the task (the trunks, each its own session); then N anchors per trunk over
its turn boundaries (`plan_anchors`, as the own loop), and per anchor k a new run of the harness on the same
task whose first k requests are answered from the trunk's record (replay: same text, same tool-call ids, the
same token ids) while its context is checked against the trunk's, token for token; from turn k on it samples
fresh. A branch whose context differs (a non-deterministic harness) is refused (409), counted
(`external/branches_refused`) and never stored.

An episode's reward is what the harness returns, or (when it returns None) what it posts to `/v1/reward`
within `env.reward_timeout_s`; both at once is refused (`external/double_rewards`). An episode a limit
ended is stored with reward 0 (`external/limit_ended`). A harness that raises, runs past
`env.harness_timeout_s` (its thread is left behind: Python cannot stop it; its later requests get 410),
returns no reward or a non-number costs that episode only: dropped, counted, logged (rate-limited:
health.py); `env.harness_max_failures` trunks in a row dropped stop the run, naming the harness. Only
whole, rewarded episodes enter the tree (a tree whose trunks all fail is dropped). Each harness run is a
daemon thread; everything else runs on the sampling loop.

Side calls (side.py): the side segments of a tree's stored episodes are returned as trees of their own,
linked to it (`side.side_trees`: meta `episode_tree`, `links`), with `env.side_calls=train`; with
`exclude` they are only counted. The tree's meta `calls` logs every call of its episodes with its parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import json
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from actors.async_loop import EpisodeRunner, gather_or_cancel
from actors.envs.base import Task
from actors.envs.tool_calls import ToolCall
from actors.external.discovery import Discovery
from actors.external.endpoint import AgentEndpoint
from actors.external.health import HarnessHealth
from actors.external.openai_format import SamplingBounds
from actors.external.render import Templates
from actors.external.session import Round, Session, TreeState, count
from actors.external.side import calls_meta, side_trees
from actors.weight_gate import WeightGate
from system.tree import RolloutTree
from system.tree_build import TreeBuilder, plan_anchors

if TYPE_CHECKING:
    from actors.tree_sampler import TreeSampler, TreeShape

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


@dataclass
class _Plan:
    task: Task
    tree_id: str
    rng: np.random.Generator
    state: TreeState = field(default_factory=TreeState)
    trunks: list[Session] = field(default_factory=list)
    builder: TreeBuilder | None = None
    finish: dict[int, str] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    stored: list[Session] = field(default_factory=list)  # the sessions whose episodes the tree holds


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
    ) -> None:
        self.harness, self.endpoint, self.templates = harness, endpoint, templates
        self.bounds, self.limits, self.side_calls = bounds, limits, side_calls
        name = name or f"{getattr(harness, '__module__', '?')}:{getattr(harness, '__qualname__', harness)}"
        self.health = HarnessHealth(name, limits.max_failures)
        self.discovery: Discovery | None = None  # its entry in RUN_DIR/agent_endpoints.json, if listed

    def grow(
        self, sampler: TreeSampler, tasks: Sequence[Task], rng: np.random.Generator, ids: Sequence[str]
    ) -> list[RolloutTree]:
        seeds = rng.integers(1 << 62, size=len(tasks))
        plans = [
            _Plan(t, i, np.random.default_rng(int(s))) for t, i, s in zip(tasks, ids, seeds, strict=True)
        ]
        for p in plans:
            p.trunks = [Session(f"{p.tree_id}/m{m}", p.state, _seed(p)) for m in range(sampler.shape.M)]
        server = sampler.turn_server()
        gate = WeightGate(server, sampler.poller, sampler.stats)
        runner = EpisodeRunner(
            server,
            sampler.env,
            sampler.chat,
            sampler.limits,
            gate,
            max_inflight=1,
            tools=None,
            stats=sampler.stats,
        )
        rnd = Round(server, gate, self.templates, sampler.limits, self.bounds, sampler.stats)
        sampler.run_async(_grow_all(self, rnd, runner, plans, sampler))
        trees = [_finish(p) for p in plans]
        sampler.dropped_trees += sum(t is None for t in trees)
        mask = sampler.limits.mask_truncated_turn
        train = self.side_calls == "train"  # else side calls are served and counted, never stored
        side = [t for p in plans if train for t in side_trees(p.tree_id, _meta(p), p.stored, mask)]
        count(sampler.stats, "external/side_trees", len(side))
        return [t for t in trees if t is not None] + side

    def metrics(self) -> dict[str, float]:
        """What the sampler's metrics add (TreeSampler.get_metrics), whether or not a round finished."""
        return {  # rejected: before reaching a session (auth, malformed JSON, no session id), since the start
            "external/rejected_requests": float(self.endpoint.rejected),
            "external/failures_in_row": float(self.health.in_row),
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


def _seed(p: _Plan) -> int:
    return int(p.rng.integers(1 << 62))


# Module functions, not methods: a class with an `async def` method becomes an asyncio actor in Ray.
async def _grow_all(
    ext: ExternalTrees, rnd: Round, runner: EpisodeRunner, plans: list[_Plan], sampler: TreeSampler
) -> None:
    slots = asyncio.Semaphore(sampler.max_inflight)
    ext.endpoint.attach(rnd, asyncio.get_running_loop())
    try:
        grow = (_grow(ext, rnd, slots, p, sampler) for p in plans)
        await runner.drive(gather_or_cancel(*grow))
    finally:
        ext.endpoint.detach()


async def _grow(
    ext: ExternalTrees, rnd: Round, slots: asyncio.Semaphore, p: _Plan, sampler: TreeSampler
) -> None:
    """One tree: its M trunks, then (committed first) its branches, then its caches freed."""
    episode = functools.partial(_episode, ext, rnd, slots, p, sampler)
    await gather_or_cancel(*(episode(s) for s in p.trunks))
    ok = [s for s in p.trunks if s.failure is None]
    if ok:
        _commit_trunks(p, ok, rnd)
        shape: TreeShape = sampler.shape
        anchors = plan_anchors([len(s.turns) for s in ok], shape.N, p.rng, shape.anchor_shortfall)
        branches = [_branch(p, ok[m], k, j) for j, (m, k) in enumerate(anchors)]
        count(rnd.stats, "external/branches", len(branches))
        await gather_or_cancel(*(episode(b) for b, _ in branches))
        for b, anchor in branches:
            if b.failure is None:
                _commit(p, b, anchor, rnd)
            elif b.failure.startswith("context mismatch"):
                count(rnd.stats, "external/branches_refused")
    sides = [seg.key for k in p.keys for seg in rnd.sessions[k].sides]
    count(rnd.stats, "external/side_calls", sum(c.segment > 0 for k in p.keys for c in rnd.sessions[k].calls))
    await rnd.server.release(*p.keys, *sides)


def _branch(p: _Plan, trunk: Session, k: int, j: int) -> tuple[Session, int]:
    """A new run of the harness whose first k turns replay `trunk`'s, under the trunk's k-th node."""
    assert p.builder is not None
    anchor = trunk.nodes[k - 1]
    s = Session(f"{p.tree_id}/b{j}", p.state, _seed(p), parent_key=trunk.key, replay=trunk.turns[:k])
    s.anchor_context = p.builder.context_tokens(anchor)
    return s, anchor


async def _episode(
    ext: ExternalTrees, rnd: Round, slots: asyncio.Semaphore, p: _Plan, sampler: TreeSampler, s: Session
) -> None:
    async with slots:
        if rnd.error is not None:  # the round is failing: no new harness run
            raise rnd.error
        rnd.sessions[s.key] = s
        p.keys.append(s.key)
        count(rnd.stats, "external/episodes")
        try:
            value, exc = await _run_harness(ext, ext.task_view(sampler, p.task, s.key), s)
            if s.failure is None:
                await _settle(ext, s, value, exc, rnd.stats)
        finally:
            s.closed = True
    if rnd.error is not None:  # the engine failed under this round: it fails as a whole
        raise rnd.error
    if s.failure is None and len(s.turns) <= s.start:
        s.failure = "the harness made no request that sampled a turn"
        count(rnd.stats, "external/no_turns")
    if s.failure is not None:
        count(rnd.stats, "external/episodes_dropped")
    stop = ext.health.episode_done(s)  # logs the drop (rate-limited); a streak at its bound stops the run
    if stop is not None:
        rnd.error = rnd.error or stop
        raise rnd.error


async def _run_harness(
    ext: ExternalTrees, task: dict[str, Any], s: Session
) -> tuple[Any, BaseException | None]:
    """Runs the harness in a daemon thread; (its return value, None) or (None, what it raised)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[tuple[Any, BaseException | None]] = loop.create_future()

    def deliver(out: tuple[Any, BaseException | None]) -> None:
        if not fut.done():
            fut.set_result(out)

    def target() -> None:
        try:
            out: tuple[Any, BaseException | None] = (ext.harness(task, ext.endpoint.url, s.key), None)
        except BaseException as exc:  # the harness's failure is its episode's, reported below
            out = (None, exc)
        with contextlib.suppress(RuntimeError):  # RuntimeError: the round is over (a run past its deadline)
            loop.call_soon_threadsafe(deliver, out)

    threading.Thread(target=target, name=f"harness-{s.key}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(fut), ext.limits.timeout_s)
    except TimeoutError:
        s.closed = True
        return None, TimeoutError(f"the harness ran past env.harness_timeout_s ({ext.limits.timeout_s:g} s)")


async def _settle(
    ext: ExternalTrees, s: Session, value: Any, exc: BaseException | None, stats: dict[str, float]
) -> None:
    """The episode's reward, or its failure. A limit's end (truncated, max_turns, token_budget) is reward 0
    whatever the harness did after it, as in the project's own loop."""
    if s.finish is not None:
        s.reward = 0.0
        count(stats, "external/limit_ended")
    elif isinstance(exc, TimeoutError):
        s.failure = str(exc)
        count(stats, "external/harness_timeouts")
    elif exc is not None:
        s.failure = f"the harness raised {type(exc).__name__}: {exc}"
        count(stats, "external/harness_errors")
    elif value is None:
        if s.posted_reward is None:
            try:
                await asyncio.wait_for(s.rewarded.wait(), ext.limits.reward_timeout_s)
            except TimeoutError:
                s.failure = f"no reward (returned None, none posted within {ext.limits.reward_timeout_s:g} s)"
                count(stats, "external/no_reward")
                return
        s.reward = s.posted_reward
    elif s.posted_reward is not None:
        s.failure = (
            f"the reward was given twice: returned {value!r} and posted {s.posted_reward:g} "
            "(return None to post it)"
        )
        count(stats, "external/double_rewards")
    elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        s.failure = f"the harness returned {value!r}, not a finite number (the reward)"
        count(stats, "external/bad_rewards")
    else:
        s.reward = float(value)


def _commit_trunks(p: _Plan, trunks: list[Session], rnd: Round) -> None:
    assert p.state.prompt is not None
    p.builder = TreeBuilder(p.tree_id, p.state.prompt.ids, prompt_id=p.task.task_id, meta=_meta(p))
    for s in trunks:
        _commit(p, s, 0, rnd)


def _meta(p: _Plan) -> dict[str, str]:
    answers = json.dumps(list(p.task.answers))
    return {"task_id": p.task.task_id, "dataset": p.task.dataset, "answers": answers, "source": "external"}


def _commit(p: _Plan, s: Session, parent: int, rnd: Round) -> None:
    """The session's own turns (after a branch's replayed prefix) into the tree, as `record_turn` does."""
    assert p.builder is not None and s.reward is not None
    for t in s.turns[s.start :]:
        cut = t.finish_reason != "stop" and rnd.limits.mask_truncated_turn
        parent = p.builder.add_turn(
            parent, t.ids, t.logprobs, loss_mask=[not cut] * len(t.ids), policy_version=t.version
        )
        if t.obs_ids:
            p.builder.set_observation(parent, t.obs_ids)
        s.nodes.append(parent)
    p.builder.set_reward(parent, s.reward)
    p.finish[parent] = s.finish or "done"
    p.stored.append(s)
    count(rnd.stats, "external/episodes_stored")


def _finish(p: _Plan) -> RolloutTree | None:
    if p.builder is None:
        return None
    p.builder.meta["finish"] = json.dumps({str(k): v for k, v in sorted(p.finish.items())})
    p.builder.meta["calls"] = calls_meta(p.stored)  # every call of its episodes: [segment, parent call]
    return p.builder.build()
