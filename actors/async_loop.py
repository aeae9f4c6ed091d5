"""The asynchronous agent loop: every episode is a coroutine that advances on its own — generate a turn,
run its tool call while other episodes generate, append the observation, generate the next turn — with at
most `max_inflight` episodes in flight.

A tool call runs in a worker thread of `tools` when it may block (a retrieval service over HTTP, a large
corpus), or on the event loop itself when `tools` is None: an in-memory lookup of a few microseconds costs
less than the hop to a thread and back, and on a busy loop that hop is what the episode waits for
(`sampler.tool_calls`, actors/tree_sampler.py).

    runner = EpisodeRunner(server, env, chat, limits, gate, max_inflight=64, tools=pool, stats=stats)
    await runner.drive(gather_or_cancel(*(runner.run(e) for e in episodes)))

The episode logic is the lockstep loop's (actors/agent_loop.py: `turn_request`, `record_turn`,
`step_turn`, `finish_turn`), so both loops build the same trees: the tree bookkeeping and the token ids are
untouched here, only the scheduling differs. A turn's draws are seeded by its episode and turn index
(`SampleRequest.seed`), so they do not depend on what ran beside it. Builders and episodes are only touched
on the event loop; the tool call (`step_turn`) reads the episode, never writes it.

Weights change only at turn boundaries (actors/weight_gate.py): the gate tells each turn its version.
Metrics (added to `stats`): `sampler/gen_s` and `sampler/tool_s` (episode-seconds spent waiting for turns
and in tool calls: summed over episodes, so they exceed wall time when episodes overlap), `sampler/turns`,
`sampler/inflight_episodes` (time-averaged episodes in flight over the last round) and
`sampler/inflight_peak` (the most at once, over the sampler's lifetime); the gate adds
`sampler/paused_for_weights_s` and `weights/apply_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from concurrent.futures import Executor
from typing import Any, TypeVar

from actors.agent_loop import Episode, LoopLimits, finish_turn, record_turn, step_turn, turn_request
from actors.envs.base import Environment
from actors.weight_gate import WeightGate
from system.policy import TurnServer

T = TypeVar("T")


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """`asyncio.gather`, except that the first failure cancels the others and waits for them to end before
    it is raised: an episode that fails must not leave its siblings running on the engine's loop (where
    nothing would ever await them). Not `asyncio.TaskGroup`: it would wrap the failure in an
    ExceptionGroup, and the driver reports a sampler's root cause from the exception itself."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class EpisodeRunner:
    """Runs episodes as coroutines over one TurnServer; see the module docstring."""

    def __init__(
        self,
        server: TurnServer,
        env: Environment,
        chat: Any,
        limits: LoopLimits,
        gate: WeightGate,
        *,
        max_inflight: int,
        tools: Executor | None,
        stats: dict[str, float],
    ) -> None:
        self.server, self.env, self.chat, self.limits, self.gate = server, env, chat, limits, gate
        self.tools, self.stats = tools, stats
        self.slots = asyncio.Semaphore(max_inflight)
        self.inflight = self.peak = 0
        self._area, self._since, self._t0 = 0.0, time.perf_counter(), time.perf_counter()
        for key in ("sampler/gen_s", "sampler/tool_s", "sampler/turns"):
            stats.setdefault(key, 0.0)

    async def run(self, e: Episode) -> None:
        """Steps one episode to its end (its last node becomes a leaf with the reward)."""
        async with self.slots:
            self._count(+1)
            try:
                while not e.done:
                    await self._turn(e)
            finally:
                self._count(-1)

    async def _turn(self, e: Episode) -> None:
        req = turn_request(e, self.chat, self.limits)
        if req is None:  # the context filled the token budget: ended
            return
        version = await self.gate.turn_started()
        t0 = time.perf_counter()
        try:
            res = await self.server.generate_turn(req)
        finally:
            self.gate.turn_ended()
        t1 = time.perf_counter()
        tokens = res.token_ids
        truncated = record_turn(e, tokens, res.logprobs, res.finish_reason, version, self.limits)
        if self.tools is None:  # a fast in-process tool: no thread hop
            result = step_turn(self.env, e, self.chat, tokens)
        else:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self.tools, step_turn, self.env, e, self.chat, tokens)
        finish_turn(e, result, truncated, tokens, self.chat, self.limits)
        s = self.stats
        s["sampler/gen_s"] += t1 - t0
        s["sampler/tool_s"] += time.perf_counter() - t1
        s["sampler/turns"] += 1

    def _count(self, delta: int) -> None:
        now = time.perf_counter()
        self._area += self.inflight * (now - self._since)
        self._since, self.inflight = now, self.inflight + delta
        self.peak = max(self.peak, self.inflight)

    async def drive(self, main: Awaitable[T]) -> T:
        """Runs `main` (the episodes) with the gate watching for weights; a failed weight load fails the
        round. Afterwards the occupancy metrics of the round go to `stats`."""
        task = asyncio.ensure_future(main)  # runs from the first await below: after the gate has closed
        try:
            await self.gate.catch_up()  # an idle sampler takes a waiting version before its first turn
            watch = self.gate.start()
            if watch is None:
                return await task
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            watch.result()  # raises the load's error
            raise RuntimeError("the weight watcher stopped")
        finally:
            if not task.done():  # a failed load: the episodes go with the round
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await self.gate.stop()
            self._count(0)
            elapsed = max(time.perf_counter() - self._t0, 1e-9)
            self.stats["sampler/inflight_episodes"] = self._area / elapsed
            peak = max(self.stats.get("sampler/inflight_peak", 0.0), float(self.peak))
            self.stats["sampler/inflight_peak"] = peak  # over the sampler's lifetime
