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
`external/context_mismatch`, and `external/branches_refused` for a branch). A side call (no assistant message
of the record: a summariser, a judge, a sub-agent, a compaction) is no mismatch: it opens or extends a side
segment of the session, sampled and recorded with its parent call (side.py). A limit ends a session as the
project's own loop does (reward 0): a cut turn (`truncated`), `env.max_turns`, `env.token_budget`. A first
prompt that leaves no room under `env.token_budget` is refused (400, `context_length_exceeded`): the episode
ends there, never stored (`external/prompt_too_long`); the engine is never asked for a turn without room.

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
from actors.external.side import Call, Segment, extend, record_call, route
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
    sides: list[Segment] = field(default_factory=list)  # its side segments (side.py)
    calls: list[Call] = field(default_factory=list)  # every call: its segment and its parent call
    main_call: int | None = None  # the main conversation's last call

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
            mismatch = s.failure.startswith("context mismatch")
            status, kind = (409, "context_mismatch") if mismatch else (400, "session_ended")
            raise ApiError(status, f"session {key!r} was refused: {s.failure}", kind)
        if s.closed:
            raise ApiError(410, f"session {key!r} is over (its episode ended or passed its deadline)", "gone")
        return s

    async def chat(self, key: str, body: Any) -> tuple[int, dict[str, Any]]:
        count(self.stats, "external/requests")
        try:
            s = self.session(key)
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


async def take_turn(rnd: Round, s: Session, req: ChatRequest) -> dict[str, Any]:
    """The session's next turn for this request (see the module docstring; a side call: side.py)."""
    n = len(s.turns)
    seg = route(s, req) if n > 0 else None
    if seg is not None:  # a side call: allowed after the main conversation ended too (a judge)
        return await side_turn(rnd, s, seg, req)
    if s.finish is not None:
        raise ApiError(400, f"session {s.key!r} ended ({s.finish}); the episode is over", "session_ended")
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


async def side_turn(rnd: Round, s: Session, seg: Segment, req: ChatRequest) -> dict[str, Any]:
    """The next turn of a side segment (side.py): sampled from its exact context, never replayed."""
    extend(rnd, s, seg, req)
    seed = mix_seed(mix_seed(s.seed, -seg.index), len(seg.turns))
    parent_key = seg.key if seg.turns else None
    turn = await generate(rnd, seg.context, req, seg.key, parent_key, seed)
    seg.turns.append(turn)
    seg.context = [*seg.context, *turn.ids]
    if turn.finish_reason != "stop":
        seg.finish = "truncated"
    seg.last_call = call = record_call(s, seg.index, seg.last_call)
    extra = {"segment": seg.index, "call": call, "parent_call": s.calls[call].parent}
    usage = (len(seg.context) - len(turn.ids), len(turn.ids))
    return body_of(rnd, s.key, len(seg.turns) - 1, turn, req, False, usage, extra)


def prompt_ids(rnd: Round, s: Session, req: ChatRequest) -> list[int]:
    """The tree's prompt ids: set by the first request of the tree, checked (messages and ids) after."""
    ids = rnd.templates.prompt_ids(req.messages, req.tools)
    budget = rnd.limits.token_budget
    if len(ids) >= budget:  # no room for one token: refused, never sent to the engine
        s.failure = f"the prompt is {len(ids)} tokens: env.token_budget ({budget}) leaves no room for a turn"
        count(rnd.stats, "external/prompt_too_long")
        raise ApiError(400, f"{s.failure}; the episode is over", "context_length_exceeded", "messages")
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
    """One fresh turn from the session's exact context."""
    turn = await generate(rnd, s.context, req, s.key, s.parent_key, mix_seed(s.seed, n))
    s.parent_key = s.key
    return turn


async def generate(
    rnd: Round, context: list[int], req: ChatRequest, key: str, parent_key: str | None, seed: int
) -> Turn:
    """One turn sampled after `context`; weights change only between turns (the gate)."""
    limits, t = rnd.limits, rnd.templates
    room = limits.token_budget - len(context)
    request = SampleRequest(
        context=list(context),
        max_new_tokens=min(limits.max_turn_tokens, room, req.max_tokens or room),
        stop_token_ids=t.stop_token_ids,
        stop_strings=t.stop_strings,
        cache_key=key,
        parent_key=parent_key,
        seed=seed,
    )
    version = await rnd.gate.turn_started()
    try:
        res = await rnd.server.generate_turn(request)
    finally:
        rnd.gate.turn_ended()
    max_calls = None if req.parallel_tool_calls else 1
    content, calls = split_turn(t.decode(res.token_ids), t.opens_think, max_calls)
    message = assistant_message(content, calls)
    return Turn(list(res.token_ids), list(res.logprobs), res.finish_reason, version, message)


def respond(rnd: Round, s: Session, turn: Turn, req: ChatRequest, replayed: bool) -> dict[str, Any]:
    """A main-conversation turn's reply; the call is recorded (its parent: the main conversation's last)."""
    s.main_call = call = record_call(s, 0, s.main_call)
    extra = {"segment": 0, "call": call, "parent_call": s.calls[call].parent}
    usage = (len(s.context) - len(turn.ids), len(turn.ids))
    return body_of(rnd, s.key, len(s.turns) - 1, turn, req, replayed, usage, extra)


def body_of(
    rnd: Round,
    key: str,
    index: int,
    turn: Turn,
    req: ChatRequest,
    replayed: bool,
    usage: tuple[int, int],
    extra: dict[str, Any],
) -> dict[str, Any]:
    finish = (
        "length" if turn.finish_reason != "stop" else "tool_calls" if "tool_calls" in turn.message else "stop"
    )
    lps = None
    if req.logprobs:
        raw = rnd.templates.token_bytes(turn.ids)
        # a token that splits a character: its bytes as they are, its text with the partial bytes as \xNN
        text = [b.decode(errors="backslashreplace") for b in raw]
        lps = [
            {"token": tok, "logprob": lp, "bytes": list(b), "top_logprobs": []}
            for tok, b, lp in zip(text, raw, turn.logprobs, strict=True)
        ]
    extra = {"session": key, "turn": index, "replayed": replayed, "token_ids": turn.ids, **extra}
    return completion_body(turn.message, finish, usage, req.model or rnd.model, lps, extra)
