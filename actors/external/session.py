"""One episode driven from outside: the requests of one session, turned into turns token-in/token-out.

    rnd = Round(server, gate, templates, limits, bounds, stats, model="policy")
    rnd.sessions[key] = Session(key, tree, seed)           # the sampler opens it for one harness run
    status, body = await rnd.chat(key, request_json)         # on the sampling loop, one request at a time

Per request: the messages must extend the session's recorded conversation exactly — its prompt messages
(the tree's: every episode of a tree shares one root), then per turn the assistant message the endpoint
returned and the messages that followed it. The new trailing messages (tool results, a user message) become
the turn's observation, as the template's delta ids (actors/external/render.py). Then the next turn is
sampled from the exact context ids, or, for a branch still inside its anchor's prefix, replayed: the
anchor's recorded turn is returned (same text, same tool-call ids, same token ids) and each request's
context is checked against the anchor's, piece by piece (prompt ids, observation ids), token for token.

The mismatch rule: a request that does not extend the recorded conversation (a harness or template that
dropped `<think>` from an earlier turn, an edited history, a non-deterministic tool result in a replay) is
refused with HTTP 409 naming the first difference; the session ends there and is never stored (counted:
`external/context_mismatch`, and `external/branches_refused` for a branch). A limit ends a session as the
project's own loop does (reward 0): a cut turn (`truncated`), `env.max_turns`, `env.token_budget`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from actors.agent_loop import LoopLimits
from actors.external.openai_format import (
    ApiError,
    ChatRequest,
    SamplingBounds,
    assistant_message,
    completion_body,
    first_difference,
    normalize_message,
    parse_chat_request,
    split_turn,
)
from actors.external.render import Templates
from actors.protocols.base import ProtocolError
from actors.weight_gate import WeightGate
from system.policy import SampleRequest, TurnServer, mix_seed

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
        """The same turn (ids, log-probs, message) without its observation: a branch checks its own."""
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
class Session:
    key: str
    tree: TreeState
    seed: int
    parent_key: str | None = None  # the backend's cache to start from (a branch: its trunk's)
    replay: list[Turn] = field(default_factory=list)  # a branch: its anchor's first k turns
    anchor_context: list[int] | None = None  # a branch: the stored context at its anchor
    turns: list[Turn] = field(default_factory=list)  # from the episode start (a branch: replay included)
    context: list[int] = field(default_factory=list)
    finish: str | None = None  # ended by a limit: truncated, max_turns, token_budget
    failure: str | None = None  # refused or failed: never stored
    closed: bool = False  # the episode is over (harness returned, deadline passed)
    busy: bool = False  # a request is being answered (a session's requests go one at a time)
    posted_reward: float | None = None
    rewarded: asyncio.Event = field(default_factory=asyncio.Event)
    reward: float | None = None  # the episode's, once settled
    nodes: list[int] = field(default_factory=list)  # the tree nodes of its own turns, once stored

    @property
    def start(self) -> int:
        return len(self.replay)

    def recorded(self) -> list[dict[str, Any]]:
        """The conversation so far as the harness must send it back: prompt, then (assistant, follow-ups)."""
        assert self.tree.prompt is not None
        out = list(self.tree.prompt.messages)
        for t in self.turns:
            out += [normalize_message(t.message, "recorded"), *t.obs_messages]
        return out


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
    ) -> None:
        self.server, self.gate, self.templates, self.limits = server, gate, templates, limits
        self.bounds, self.stats, self.model = bounds, stats, model
        self.sessions: dict[str, Session] = {}
        self.error: Exception | None = None  # a failure of the sampler itself (not of a harness)

    def session(self, key: str) -> Session:
        s = self.sessions.get(key)
        if s is None:
            why = f"unknown session {key!r} (a session lives while the sampler runs its episode)"
            raise ApiError(404, why, "not_found_error")
        if s.failure is not None:
            raise ApiError(409, f"session {key!r} was refused: {s.failure}", "context_mismatch")
        if s.closed:
            raise ApiError(410, f"session {key!r} is over (its episode ended or passed its deadline)", "gone")
        return s

    async def chat(self, key: str, body: Any) -> tuple[int, dict[str, Any]]:
        count(self.stats, "external/requests")
        try:
            s = self.session(key)
            if s.finish is not None:
                why = f"session {key!r} ended ({s.finish}); the episode is over"
                raise ApiError(400, why, "session_ended")
            if s.busy:
                raise ApiError(
                    400, f"session {key!r} has a request in flight: send one at a time", "session_busy"
                )
            s.busy = True
            try:
                return 200, await take_turn(self, s, parse_chat_request(body, self.bounds))
            except ProtocolError as exc:  # the messages are the harness's: a template that cannot render them
                raise ApiError(400, f"messages: {exc}", param="messages") from None
            finally:
                s.busy = False
        except ApiError as exc:
            count(self.stats, "external/bad_requests" if exc.status < 409 else "external/refused_requests")
            if exc.status == 409 and key in self.sessions and self.sessions[key].failure is None:
                self.sessions[key].failure = f"context mismatch: {exc.message}"
                count(self.stats, "external/context_mismatch")
            return exc.status, exc.payload()
        except Exception as exc:  # the engine failed: the round fails with it once the harness is done
            log.exception("the agent endpoint failed on a request of session %s", key)
            self.error = self.error or exc
            return 500, ApiError(
                500, f"the sampler failed: {type(exc).__name__}: {exc}", "server_error"
            ).payload()

    async def reward(self, key: str, body: Any) -> tuple[int, dict[str, Any]]:
        """POST /v1/reward: {"reward": number} for the session (the harness may also return it)."""
        try:
            s = self.sessions.get(key)
            if s is None or s.failure is not None:
                raise ApiError(404, f"unknown or refused session {key!r}", "not_found_error")
            value = body.get("reward") if isinstance(body, dict) else None
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ApiError(400, f"reward: expected a finite number, got {value!r}", param="reward")
            s.posted_reward = float(value)
            s.rewarded.set()
            return 200, {"session": key, "reward": s.posted_reward}
        except ApiError as exc:
            return exc.status, exc.payload()


async def take_turn(rnd: Round, s: Session, req: ChatRequest) -> dict[str, Any]:
    """The session's next turn for this request (see the module docstring)."""
    n = len(s.turns)
    if n == 0:
        s.context = prompt_ids(rnd, s, req)
    elif not observe(rnd, s, req, n):
        raise _limit_reached(s)
    if n < s.start:  # a branch inside its anchor's prefix: the recorded turn again
        turn = s.replay[n].replayed()
        s.turns.append(turn)
        s.context = [*s.context, *turn.ids]
        return respond(rnd, s, turn, req, replayed=True)
    if s.anchor_context is not None and n == s.start and s.context != s.anchor_context:
        raise ApiError(
            409, "the branch's context differs from its anchor's stored context", "context_mismatch"
        )
    turn = await sample(rnd, s, req, n)
    s.turns.append(turn)
    s.context = [*s.context, *turn.ids]
    if turn.finish_reason != "stop":
        s.finish = "truncated"  # a cut turn cannot be continued: terminal, reward 0 (as the own loop)
    return respond(rnd, s, turn, req, replayed=False)


def prompt_ids(rnd: Round, s: Session, req: ChatRequest) -> list[int]:
    """The tree's prompt ids: set by the first request of the tree, checked (messages and ids) after."""
    ids = rnd.templates.prompt_ids(req.messages, req.tools)
    tree = s.tree
    if tree.prompt is None and not s.replay:
        tree.prompt = Prompt(req.messages, req.tools, ids)
        return list(ids)
    assert tree.prompt is not None
    if req.tools != tree.prompt.tools:
        raise ApiError(
            409, "tools differ from the ones this tree's episodes started with", "context_mismatch"
        )
    why = first_difference(req.messages, tree.prompt.messages)
    if why is not None or len(req.messages) != len(tree.prompt.messages) or ids != tree.prompt.ids:
        why = why or "the first messages differ from this tree's prompt"
        raise ApiError(409, f"{why} (every episode of a tree starts from its prompt)", "context_mismatch")
    return list(ids)


def observe(rnd: Round, s: Session, req: ChatRequest, n: int) -> bool:
    """Checks that the request extends the recorded conversation and appends the new messages' delta ids
    (False, nothing appended: a limit ends the session before the next turn)."""
    assert s.tree.prompt is not None
    if req.tools != s.tree.prompt.tools:  # the prompt was rendered with the first request's tools
        raise ApiError(409, "tools differ from the ones this episode started with", "context_mismatch")
    recorded = s.recorded()
    why = first_difference(req.messages, recorded)
    if why is not None:
        raise ApiError(
            409, f"{why}: the request must extend the conversation as returned", "context_mismatch"
        )
    new = req.messages[len(recorded) :]
    if not new or any(m["role"] == "assistant" for m in new):
        why = "the request must add tool or user messages after the last assistant turn, and no assistant one"
        raise ApiError(409, why, "context_mismatch")
    last = s.turns[-1]
    delta = rnd.templates.delta_ids(new, last.ids)
    if n <= s.start:  # a branch: the observation must be its anchor's, message for message and id for id
        want = s.replay[n - 1]
        if new != want.obs_messages or delta != want.obs_ids:
            diff = "messages" if new != want.obs_messages else "token ids"
            why = (
                f"the messages after turn {n} differ from the anchor's ({diff}): a non-deterministic harness?"
            )
            raise ApiError(409, why, "context_mismatch")
    if n >= rnd.limits.max_turns:
        s.finish = "max_turns"
        return False
    if len(s.context) + len(delta) >= rnd.limits.token_budget:
        s.finish = "token_budget"
        return False
    last.obs_messages, last.obs_ids = new, delta
    s.context = [*s.context, *delta]
    return True


def _limit_reached(s: Session) -> ApiError:
    if s.finish == "max_turns":
        return ApiError(400, f"session {s.key!r} reached env.max_turns: the episode is over", "max_turns")
    why = f"session {s.key!r}: the context reached env.token_budget: the episode is over"
    return ApiError(400, why, "context_length_exceeded")


async def sample(rnd: Round, s: Session, req: ChatRequest, n: int) -> Turn:
    """One fresh turn from the session's exact context; weights change only between turns (the gate)."""
    limits, t = rnd.limits, rnd.templates
    room = limits.token_budget - len(s.context)
    request = SampleRequest(
        context=list(s.context),
        max_new_tokens=min(limits.max_turn_tokens, room, req.max_tokens or room),
        stop_token_ids=t.stop_token_ids,
        stop_strings=t.stop_strings,
        cache_key=s.key,
        parent_key=s.parent_key,
        seed=mix_seed(s.seed, n),
    )
    version = await rnd.gate.turn_started()
    try:
        res = await rnd.server.generate_turn(request)
    finally:
        rnd.gate.turn_ended()
    s.parent_key = s.key
    content, calls = split_turn(t.decode(res.token_ids), t.opens_think)
    message = assistant_message(content, calls)
    return Turn(list(res.token_ids), list(res.logprobs), res.finish_reason, version, message)


def respond(rnd: Round, s: Session, turn: Turn, req: ChatRequest, replayed: bool) -> dict[str, Any]:
    finish = (
        "length" if turn.finish_reason != "stop" else "tool_calls" if "tool_calls" in turn.message else "stop"
    )
    lps = None
    if req.logprobs:
        toks = rnd.templates.token_strings(turn.ids)
        lps = [
            {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
            for tok, lp in zip(toks, turn.logprobs, strict=True)
        ]
    extra = {"session": s.key, "turn": len(s.turns) - 1, "replayed": replayed, "token_ids": turn.ids}
    usage = (len(s.context) - len(turn.ids), len(turn.ids))
    return completion_body(turn.message, finish, usage, req.model or rnd.model, lps, extra)
