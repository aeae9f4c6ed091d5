"""One episode driven from outside: the requests of one session, turned into turns token-in/token-out.

    rnd = Round(server, gate, templates, limits, bounds, stats, model="policy")
    rnd.sessions[key] = Session(key, tree, seed)           # the sampler opens it for one harness run
    status, body = await chat(rnd, key, request)             # turns.py: on the sampling loop

A session's requests are its *calls*, in order, each in a *conversation* (`Conversation`): its first request
opens conversation 0; a request that extends a conversation's recorded messages (prompt, then per turn the
assistant message returned and the messages after it) with the same tools is that conversation's next turn;
one without an assistant message opens a new conversation (a summariser, a judge, a sub-agent, a
compaction); which request goes where: side.py. Each turn is sampled after its conversation's exact ids
(the prompt's rendering, the sampled ids, the observations' delta ids: render.py), or, for a branch before
its anchor, answered from its trunk's record (replay.py); turns.py does one call. Which calls make the
episode's line (its tree) and which are side trees is decided once the episode is over (line.py).

Refusals: a request that rewrites a conversation (an assistant message never returned, a history without
its `<think>` blocks) is refused with HTTP 409 naming the first difference, and so is a change of tools
on a conversation (`env.tool_change=refuse`, the default; `continue` opens a new conversation for it,
counted and logged); the session ends there, never stored (`external/context_mismatch`). A limit ends a
conversation (400): a cut turn, `env.max_turns`, `env.token_budget`; an episode whose line ends in one is
stored with reward 0, as the own loop's. A re-send of the session's last request (a client's retry) is
answered from the record: the same turn, no new call; one sent while the first is in flight waits for it.

Rewards (`POST /v1/reward`): one per session, while its episode runs; a second one gets a 409
(`external/double_rewards`), one after the episode a 410.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from actors.agent_loop import LoopLimits
from actors.external.openai_format import ApiError, SamplingBounds, normalize_message
from actors.external.render import Templates
from actors.external.replay import PrefixReplay
from actors.weight_gate import WeightGate
from system.policy import TurnServer

log = logging.getLogger(__name__)


@dataclass
class Turn:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    message: dict[str, Any]  # as returned to the harness
    obs_messages: list[dict[str, Any]] = field(default_factory=list)  # normalized, after this turn
    obs_ids: list[int] = field(default_factory=list)

    def replayed(self) -> Turn:
        """The same turn (ids, log-probs, message) without its observation: a branch records its own."""
        return Turn(self.ids, self.logprobs, self.finish_reason, self.version, self.message)


@dataclass
class Prompt:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    ids: list[int]


@dataclass
class TreeState:
    """What a tree's sessions share: the root prompt, set by the first request of its first episode."""

    prompt: Prompt | None = None


@dataclass
class Conversation:
    """One conversation of a session: its prompt and turns, sampled after its own exact context."""

    index: int  # 0: the one the session's first request opened
    key: str  # the backend's cache key (conversation 0: the session's)
    messages: list[dict[str, Any]]  # its prompt
    tools: list[dict[str, Any]]
    ids: list[int]  # the prompt's ids
    first_call: int
    parent_key: str | None = None  # the cache to start from (a branch: its trunk's conversation's)
    tool_change_of: int | None = None  # opened by a change of tools on that conversation (continue)
    turns: list[Turn] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # the session's call of each turn
    context: list[int] = field(default_factory=list)
    finish: str | None = None  # ended by a limit: truncated, max_turns, token_budget

    def recorded(self) -> list[dict[str, Any]]:
        """What the harness must send back: the prompt, then per turn (assistant message, follow-ups)."""
        out = list(self.messages)
        for t in self.turns:
            out += [normalize_message(t.message, "recorded"), *t.obs_messages]
        return out


@dataclass(frozen=True)
class Call:
    conv: int  # its conversation (Session.convs index)
    parent: int | None  # the call whose conversation it extends (None: it opened the conversation)
    context: list[int]  # the ids it was sampled (or replayed) after
    sig: str  # the request's signature (openai_format.ChatRequest.sig): a re-send is a retry
    replayed: bool = False


@dataclass
class Session:
    key: str
    tree: TreeState
    seed: int
    replay: PrefixReplay | None = None  # a branch: its trunk's calls before the anchor (replay.py)
    trunk_keys: dict[int, str] = field(default_factory=dict)  # a branch: its trunk's conversations' caches
    convs: list[Conversation] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)  # every call, in order
    failure: str | None = None  # refused or failed: never stored
    closed: bool = False  # the episode is over (harness returned, deadline passed)
    busy: bool = False  # a request is being answered (a session's requests go one at a time)
    inflight: tuple[str, asyncio.Future[dict[str, Any]]] | None = None  # (signature, its answer)
    last_body: dict[str, Any] | None = None  # the last call's answer: a retry gets it again
    posted_reward: float | None = None
    rewarded: asyncio.Event = field(default_factory=asyncio.Event)
    reward: float | None = None  # the episode's, once settled
    finish: str | None = None  # the limit its line ended in (line.py), once over
    line: list[int] = field(default_factory=list)  # the calls of its tree's line (line.py), once over
    nodes: dict[int, int] = field(default_factory=dict)  # line call -> its tree node, once stored
    no_agent: bool = False  # dropped because no agent took the episode (remote.py)

    @property
    def start(self) -> int:
        """The calls answered from the trunk's record (a branch: its anchor's call index; else 0)."""
        return 0 if self.replay is None else self.replay.upto


def count(stats: dict[str, float], key: str, n: float = 1.0) -> None:
    stats[key] = stats.get(key, 0.0) + n


class Round:
    """The sessions of one sampling round and their requests; lives on the sampling loop."""

    def __init__(
        self,
        server: TurnServer,
        gate: WeightGate,
        templates: Templates,
        limits: LoopLimits,
        bounds: SamplingBounds,
        stats: dict[str, float],
        model: str = "policy",
        tool_change: str = "refuse",
    ) -> None:
        self.server, self.gate, self.templates, self.limits = server, gate, templates, limits
        self.bounds, self.stats, self.model, self.tool_change = bounds, stats, model, tool_change
        self.sessions: dict[str, Session] = {}
        self.error: Exception | None = None  # a failure of the sampler itself (not of a harness)

    def session(self, key: str) -> Session:
        s = self.sessions.get(key)
        if s is None:
            why = f"unknown session {key!r} (a session lives while the sampler runs its episode)"
            raise ApiError(404, why, "not_found_error")
        if s.failure is not None:
            mismatch = s.failure.startswith("context mismatch")
            status, kind = (409, "context_mismatch") if mismatch else (400, "session_ended")
            raise ApiError(status, f"session {key!r} was refused: {s.failure}", kind)
        if s.closed:
            raise ApiError(410, f"session {key!r} is over (its episode ended or passed its deadline)", "gone")
        return s

    async def reward(self, key: str, body: Any) -> tuple[int, dict[str, Any]]:
        """POST /v1/reward: {"reward": number} for the session (the harness may also return it)."""
        count(self.stats, "external/reward_posts")
        try:
            s = self.sessions.get(key)
            if s is None or s.failure is not None:
                raise ApiError(404, f"unknown or refused session {key!r}", "not_found_error")
            if s.closed:
                raise ApiError(410, f"session {key!r} is over: its reward is settled", "gone")
            value = body.get("reward") if isinstance(body, dict) else None
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ApiError(400, f"reward: expected a finite number, got {value!r}", param="reward")
            if s.posted_reward is not None:
                count(self.stats, "external/double_rewards")
                why = f"session {key!r}: a reward was already posted ({s.posted_reward:g}); one per episode"
                raise ApiError(409, why, "reward_already_posted")
            s.posted_reward = float(value)
            s.rewarded.set()
            return 200, {"session": key, "reward": s.posted_reward}
        except ApiError as exc:
            return exc.status, exc.payload()
