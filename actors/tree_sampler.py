"""The sampler role: initialize–expand rollout trees (docs/algorithm.md §2) for admitted prompts, committed to
the store. Built from a config by `runtime/builder.py:make_sampler`; on Ray an actor holds one
(runtime/sampler_role.py) and forwards its calls.

    sampler = TreeSampler(backend, env, ChatFormat.from_tokenizer(tok), TreeShape(M=4, N=2), LoopLimits(),
                          weights=sink, store=store, tasks=tasks, rng=np.random.default_rng(0))
    sampler.sample_and_commit(4)                     # admission → 4 trees → store.put_raw
    trees = sampler.sample_trees(tasks, rng)         # the trees alone: one per task, K = M + branches

Per tree: phase 1 samples its M initial trajectories, phase 2 picks N anchors per trajectory over its
non-terminal boundaries and samples every branch. A branch starts from its anchor's exact stored context
(`TreeBuilder.context_tokens`: prompt, turns and observations, token ids as sampled) and the calls made so
far: the tools are pure, so replaying the calls restores the environment; nothing is re-executed or
re-tokenized. Flat methods (GRPO/GSPO) are the special case M = G, N = 0.

Two loops run the same episodes (`loop`, `sampler.loop`): "async" (actors/async_loop.py) runs every
episode and branch as its own coroutine, up to `max_inflight` at once, and a tree's branches start as soon
as its own trajectories are done; "lockstep" (actors/agent_loop.py) steps all trajectories of all trees
together, one backend call per round of turns, then all branches. Each tree draws its anchors from its own
generator and each turn from its own seed (both derived from `rng` in task order), so both loops give the
same trees (HF backend: the same ids; log-probs up to batched float rounding). New weights are applied
between turns, and before each call (`catch_up`), always by `weight_gate.load_version`: the async loop's
gate between turns, the lockstep loop between rounds of turns.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from actors.agent_loop import Episode, LoopLimits, run_episodes
from actors.async_loop import EpisodeRunner
from actors.chat import ChatFormat
from actors.envs.base import EnvFailure, Environment, Task
from actors.heap import frozen_count
from actors.tree_plan import TreePlan, branch_episode, first_episode, grow_all
from actors.turn_server import BatchedTurns, as_turn_server
from actors.weight_gate import WeightGate, WeightPoller, load_version
from system.interfaces import StoreClient, StoreUnavailable, WeightSink
from system.policy import PolicyBackend, TurnServer
from system.roles import Closeable, Counters
from system.staleness import cut_turns
from system.tree import RolloutTree
from system.tree_build import TreeBuilder, plan_anchors

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeShape:
    M: int = 4
    N: int = 2
    anchor_shortfall: str = "skip"


@dataclass(frozen=True)
class Grown:
    """What a tree source returns: the trees, and how many trees it dropped (all their episodes failed)."""

    trees: list[RolloutTree]
    dropped: int = 0


class TreeSource(Protocol):
    """Where trees come from instead of the own agent loop: a harness driven through the agent endpoint
    (actors/external/trees.py, `env.harness`). Admission, commit and metrics stay the sampler's. A source
    reads the sampler's `env`, `shape`, `limits` and `max_inflight`, and runs its episodes through
    `sampler.run_round` (the backend, the weight gate, the sampler's occupancy counters); it keeps its own
    counters (`metrics()`, joined to the sampler's) and writes nothing of the sampler's."""

    def grow(
        self, sampler: TreeSampler, tasks: Sequence[Task], rng: np.random.Generator, ids: Sequence[str]
    ) -> Grown: ...

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...


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
        loop: str = "async",
        max_inflight: int = 64,
        tool_calls: str = "auto",
        tool_threads: int = 16,
        external: TreeSource | None = None,
    ) -> None:
        if loop not in ("async", "lockstep"):
            raise ValueError(f"loop must be 'async' or 'lockstep', got {loop!r}")
        if tool_calls not in ("auto", "inline", "threads"):
            raise ValueError(f"tool_calls must be 'auto', 'inline' or 'threads', got {tool_calls!r}")
        self.backend, self.env, self.chat = backend, env, chat
        self.shape, self.limits, self.weights, self.store = shape, limits, weights, store
        self.loop, self.max_inflight = loop, max_inflight
        self.inline_tools = tool_calls == "inline" or (
            tool_calls == "auto" and bool(getattr(env, "inline_tools", False))
        )  # auto: the env says whether its tools are fast in-process lookups
        self.tool_threads = tool_threads
        self.external = external  # trees from a harness (env.harness) instead of the own loop
        # every poll of the sink goes through one thread (the async loop polls while episodes run)
        self.poller = WeightPoller(weights) if weights is not None else None
        self._server: TurnServer | None = None
        self._tools: ThreadPoolExecutor | None = None
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
        commits them to the store; unused reservations go back. Returns counts and the metrics snapshot.
        A store that cannot be reached ends the call with nothing admitted (`sampler/store_unavailable`):
        trees a failed put_raw may still have committed stay committed (the store's own log), the others
        were never visible, and the reservation went back before the raise or with the store's restart."""
        if self.store is None:
            raise RuntimeError("sample_and_commit needs a store (TreeSampler(..., store=...))")
        try:
            self.catch_up(min_version, wait_s)  # an idle sampler takes new weights here; sync mode waits
            granted = self.store.admit(n)
            if granted == 0:  # the learner is η versions behind: the caller backs off
                return self._result(0.0, 0.0)
            try:
                trees = self.sample(granted)
                if trees:
                    self.store.put_raw(trees)  # the durable commit: the store writes the bytes it receives
                    self._trees_stored(trees)
            except BaseException:
                self.store.release(granted)  # give the reservation back before failing
                raise
            mains = sum("episode_tree" not in t.meta for t in trees)  # side trees take no reservation
            if granted > mains:
                self.store.release(granted - mains)  # trees dropped by on_verifier_error=drop_tree
        except StoreUnavailable:
            self.stats["sampler/store_unavailable"] = self.stats.get("sampler/store_unavailable", 0.0) + 1
            return self._result(0.0, 0.0, store_unavailable=1.0)
        lag = max((self.version() - min(t.versions) for t in trees), default=0)
        return self._result(float(granted), float(len(trees)), lag=float(lag))

    def _result(self, admitted: float, trees: float, **extra: float) -> dict[str, Any]:
        """A call's counts, with the metrics snapshot (riding along: no extra, blocking call) and the
        incarnation whose counters they are (a restarted sampler counts from 0 again)."""
        out = {"admitted": admitted, "trees": trees, **extra}
        return {**out, "metrics": self.get_metrics(), "incarnation": self.prefix}

    def catch_up(self, min_version: int = 0, wait_s: float = 0.0) -> None:
        """Loads the newest version the publisher has sent, if newer than the backend's; waits (up to
        `wait_s`) until the weights reach `min_version` (the synchronous mode). No turn is in flight here:
        before a call, or between the lockstep loop's rounds."""
        t0, poll_ms = time.perf_counter(), 0
        while self.poller is not None:
            got = self.poller.poll(poll_ms)
            if got is not None and got[0] > self.version():
                self.run_async(load_version(self.turn_server(), got[0], got[1], self.stats))
            if self.version() >= min_version or time.perf_counter() - t0 >= wait_s:
                break
            poll_ms = 100
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
        turns = sum(len(t.nodes) - 1 for t in trees)
        self.stats["sampler/truncated_frac"] = sum(cut_turns(t) for t in trees) / max(turns, 1)  # this call's
        return trees

    def get_metrics(self) -> dict[str, float]:
        stats = dict(self.stats)
        stats.update(self.env.metrics())  # e.g. env/retrieval_errors (a retrieval service)
        if isinstance(self.weights, Counters):  # e.g. weights/rejected (the subscriber; no in-memory sink)
            stats.update(self.weights.metrics())
        if self.external is not None:  # e.g. external/rejected_requests (the agent endpoint)
            stats.update(self.external.metrics())
        stats["sampler/version"] = float(self.version())
        stats["sampler/gc_frozen"] = float(frozen_count())  # long-lived objects out of collections
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
        if self.external is not None:
            grown = self.external.grow(self, tasks, rng, ids)
            self.dropped_trees += grown.dropped
            return grown.trees
        seeds = rng.integers(1 << 62, size=len(tasks))  # one generator per tree: any loop order, same tree
        plans = []
        for task, tree_id, seed in zip(tasks, ids, seeds, strict=True):
            try:
                plans.append(self._plan(task, tree_id, int(seed)))
            except EnvFailure as exc:  # an outside env that cannot even reset for this task: one line
                self.dropped_trees += 1
                log.warning("%s; tree %s dropped", exc, tree_id)
        if self.loop == "async":
            self.run_async(grow_all(self._episode_runner(), plans, self._expand))
        else:
            self._lockstep(plans)
        trees = [self._finish(p) for p in plans]
        return [t for t in trees if t is not None]

    def _plan(self, task: Task, tree_id: str, seed: int) -> TreePlan:
        b = self._builder(task, tree_id)
        rng = np.random.default_rng(seed)
        trunks = [first_episode(task, b, f"{b.tree_id}/m{m}", rng) for m in range(self.shape.M)]
        return TreePlan(task, b, rng, trunks)

    def _expand(self, p: TreePlan) -> list[Episode]:
        """Phase 2 of one tree, once its trajectories are done: the branches from its planned anchors."""
        if any(e.dropped for e in p.trunks):  # a trunk that is not trained on: its tree goes (_finish)
            return []
        if not any(e.nodes for e in p.trunks):
            raise ValueError(f"task {p.task.task_id}: the prompt alone exceeds the token budget")
        counts = [len(e.nodes) for e in p.trunks]
        anchors = plan_anchors(counts, self.shape.N, p.rng, self.shape.anchor_shortfall)
        return [branch_episode(p, p.trunks[m], k, j) for j, (m, k) in enumerate(anchors)]

    def _lockstep(self, plans: list[TreePlan]) -> None:
        self._run([e for p in plans for e in p.trunks])
        for p in plans:
            p.branches = self._expand(p)
        self._run([e for p in plans for e in p.branches])
        self.backend.evict(*(e.key for p in plans for e in p.episodes))  # e.g. the HF backend's KV caches

    def _episode_runner(self) -> EpisodeRunner:
        server = self.turn_server()
        gate = WeightGate(server, self.poller, self.stats)
        return EpisodeRunner(
            server,
            self.env,
            self.chat,
            self.limits,
            gate,
            max_inflight=self.max_inflight,
            tools=self._tool_pool(),
            stats=self.stats,
        )

    # ---- the backend as the asynchronous loops see it (the own loop, external trees: SamplerRole) ----
    def turn_server(self) -> TurnServer:
        """The backend as a TurnServer (one for the sampler's life: BatchedTurns keeps its thread)."""
        if self._server is None:
            self._server = as_turn_server(self.backend)
        return self._server

    def run_round(self, episodes: Callable[[TurnServer, WeightGate], Awaitable[T]]) -> T:
        """Runs `episodes(server, gate)` to its end with the weight gate watching (a tree source's round):
        new weights between turns, the round's occupancy in the sampler's counters."""
        server = self.turn_server()
        gate = WeightGate(server, self.poller, self.stats)
        runner = EpisodeRunner(
            server, self.env, self.chat, self.limits, gate, max_inflight=1, tools=None, stats=self.stats
        )
        return self.run_async(runner.drive(episodes(server, gate)))

    def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine over the turn server to its end, on the loop it needs (vLLM: the engine's)."""
        return self.turn_server().run_async(coro)

    def _tool_pool(self) -> ThreadPoolExecutor | None:
        """None: tool calls run on the event loop (`inline_tools`). Otherwise a pool, because a tool that
        may block (HTTP, a large index) must not hold up every other episode's next turn."""
        if self.inline_tools:
            return None
        if self._tools is None:
            threads = min(self.tool_threads, self.max_inflight)
            self._tools = ThreadPoolExecutor(threads, thread_name_prefix="tools")
        return self._tools

    def _finish(self, p: TreePlan) -> RolloutTree | None:
        if any(e.verifier_failed for e in p.episodes) and self.limits.on_verifier_error == "drop_tree":
            self.dropped_trees += 1
            return None
        dropped = [e for e in p.episodes if e.dropped]
        if any(e.dropped for e in p.trunks):
            self.dropped_trees += 1
            log.warning(
                "tree %s dropped: %s", p.builder.tree_id, next(e.dropped for e in p.trunks if e.dropped)
            )
            return None
        ids: dict[int, int] = {}
        if dropped:  # dropped branches leave the tree; the others' node ids are renumbered
            ids = p.builder.remove(n for e in dropped for n in e.nodes)
            p.builder.meta["dropped_branches"] = json.dumps([e.dropped for e in dropped])
            self.stats["sampler/dropped_branches"] = self.stats.get("sampler/dropped_branches", 0.0) + len(
                dropped
            )
        ends = {
            str(ids.get(e.nodes[-1], e.nodes[-1])): e.finish for e in p.episodes if e.nodes and not e.dropped
        }
        p.builder.meta["finish"] = json.dumps(ends)
        return p.builder.build()

    def _trees_stored(self, trees: Sequence[RolloutTree]) -> None:
        """An outside env's live instances of these trees' tasks are closed (actors/envs/gym)."""
        close_tasks = getattr(self.env, "close_tasks", None)
        if close_tasks is not None:
            close_tasks(sorted({str(t.meta.get("task_id")) for t in trees}))

    def _run(self, episodes: list[Episode]) -> None:
        run_episodes(episodes, self.backend, self.env, self.chat, self.limits, between_rounds=self.catch_up)

    def _builder(self, task: Task, tree_id: str) -> TreeBuilder:
        own = getattr(self.env, "prompt_messages", None)  # an outside env: the task's own messages
        if own is not None:
            prompt = self.chat.context_of(own(task))  # type: ignore[attr-defined]
        else:
            prompt = self.chat.initial_context(self.env.system_prompt(), self.env.user_prompt(task))
        meta = {"task_id": task.task_id, "dataset": task.dataset, "answers": json.dumps(list(task.answers))}
        return TreeBuilder(tree_id, prompt, prompt_id=task.task_id, meta=meta)

    def close(self) -> None:
        if self.external is not None:
            self.external.close()
        env_close = getattr(self.env, "close", None)  # an outside env: its instances, its worker
        if env_close is not None:
            env_close()
        if self._tools is not None:
            self._tools.shutdown()
        if self.poller is not None:
            self.poller.close()
        if isinstance(self.weights, Closeable):
            self.weights.close()  # the subscriber's socket
        if isinstance(self._server, BatchedTurns):
            self._server.close()
        self.backend.close()
