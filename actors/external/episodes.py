"""One harness run, as an episode of a tree (trees.py grows the trees):

    await run_episode(ext, rnd, slots, p, sampler, session)   # its session open while the harness runs

The session's key opens its routes while the harness runs (and expires after); the harness runs in a
daemon thread; its reward is what it returns, or (when it returns None) what it posts to `/v1/reward`
within `env.reward_timeout_s`; both at once is refused (`external/double_rewards`). Once it returned, the
episode's line is decided (line.py); a line that ended in a limit is stored with reward 0
(`external/limit_ended`). A harness that raises, runs past `env.harness_timeout_s` (its thread is left
behind: Python cannot stop it; its later requests get 410), returns no reward or a non-number costs that
episode only: dropped, counted, logged (rate-limited: health.py); `env.harness_max_failures` trunks in a
row dropped stop the run, naming the harness. An episode no agent took (remote.py `NoAgent`) is dropped and
counted (`external/no_agent`) without counting toward that streak.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from actors.envs.base import Task
from actors.external.endpoint import AgentEndpoint
from actors.external.health import HarnessHealth
from actors.external.line import episode_line
from actors.external.remote import NoAgent
from actors.external.session import Round, Session, TreeState, count
from system.tree_build import TreeBuilder

if TYPE_CHECKING:
    from actors.tree_sampler import TreeSampler


class Source(Protocol):
    """What an episode uses of its tree source (trees.py `Source`)."""

    harness: Callable[[dict[str, Any], str, str], Any]
    endpoint: AgentEndpoint
    limits: Any  # trees.HarnessLimits: timeout_s, reward_timeout_s
    health: HarnessHealth

    def task_view(self, sampler: TreeSampler, task: Task, session: str) -> dict[str, Any]: ...


@dataclass
class TreePlan:
    """One tree being grown: its task, its generator (anchors, seeds), its sessions and builder."""

    task: Task
    tree_id: str
    rng: np.random.Generator
    state: TreeState = field(default_factory=TreeState)
    trunks: list[Session] = field(default_factory=list)
    builder: TreeBuilder | None = None
    finish: dict[int, str] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    stored: list[Session] = field(default_factory=list)  # the sessions whose episodes the tree holds
    anchors: dict[str, dict[str, int]] = field(default_factory=dict)  # per stored branch: its anchor


async def run_episode(
    ext: Source, rnd: Round, slots: asyncio.Semaphore, p: TreePlan, sampler: TreeSampler, s: Session
) -> None:
    async with slots:
        if rnd.error is not None:  # the round is failing: no new harness run
            raise rnd.error
        rnd.sessions[s.key] = s
        p.keys.append(s.key)
        ext.endpoint.opened(s.key)
        count(rnd.stats, "external/episodes")
        try:
            value, exc = await _run_harness(ext, ext.task_view(sampler, p.task, s.key), s)
            if s.convs:
                episode_line(s)
            if s.failure is None:
                await _settle(ext, s, value, exc, rnd.stats)
        finally:
            s.closed = True
            ext.endpoint.ended(s.key)
    if rnd.error is not None:  # the engine failed under this round: it fails as a whole
        raise rnd.error
    if s.failure is None and len(s.calls) <= s.start:
        s.failure = "the harness made no request that sampled a turn"
        count(rnd.stats, "external/no_turns")
    if s.failure is not None:
        count(rnd.stats, "external/episodes_dropped")
    stop = ext.health.episode_done(s)  # logs the drop (rate-limited); a streak at its bound stops the run
    if stop is not None:
        rnd.error = rnd.error or stop
        raise rnd.error


async def _run_harness(ext: Source, task: dict[str, Any], s: Session) -> tuple[Any, BaseException | None]:
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
    ext: Source, s: Session, value: Any, exc: BaseException | None, stats: dict[str, float]
) -> None:
    """The episode's reward, or its failure. A line that a limit ended (truncated, max_turns, token_budget)
    is reward 0 whatever the harness did after it, as in the project's own loop."""
    if s.finish is not None:
        s.reward = 0.0
        count(stats, "external/limit_ended")
    elif isinstance(exc, NoAgent):
        s.failure, s.no_agent = str(exc), True
        count(stats, "external/no_agent")
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
