"""One call of a session: the request routed to its conversation (side.py), its context ids rendered off the
sampling loop (render.py), then its turn replayed from the trunk's record (a branch before its anchor,
replay.py) or sampled, recorded and returned (session.py has the rules).

    status, body = await chat(rnd, key, request_json)   # on the sampling loop: parsed off it, a retry
                                                        # answered from the record, else take_turn:
    body = await take_turn(rnd, s, req)                 # the call; an ApiError for a refusal or a limit

Rendering and tokenizing run in a worker thread, not on the loop that samples every session's turns: a
large prompt costs its own session the time, not the others. A cheap bound first: a request whose text
alone needs more tokens than `env.token_budget` allows (its characters over the longest token's) is
refused before anything is rendered.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from actors.external.openai_format import (
    ApiError,
    ChatRequest,
    assistant_message,
    completion_body,
    first_difference,
    parse_chat_request,
    split_turn,
)
from actors.external.replay import ReplayMismatch
from actors.external.session import Call, Conversation, Prompt, Round, Session, Turn, count
from actors.external.side import conversation_tools_changed, route
from actors.protocols.base import ProtocolError
from system.policy import SampleRequest, mix_seed

log = logging.getLogger(__name__)


async def chat(rnd: Round, key: str, body: Any) -> tuple[int, dict[str, Any]]:
    """One chat-completions request of session `key` (status, body): parsed in a worker thread, then the
    session's next call, or a retry's answer from the record (session.py has the rules)."""
    count(rnd.stats, "external/requests")
    try:
        rnd.session(key)
        req = await asyncio.to_thread(parse_chat_request, body, rnd.bounds)
        s = rnd.session(key)  # it may have ended meanwhile
        if s.inflight is not None and s.inflight[0] == req.sig:  # the same request again: its answer
            count(rnd.stats, "external/retries")
            return 200, await asyncio.shield(s.inflight[1])
        if s.busy:
            raise ApiError(
                400, f"session {key!r} has a request in flight: send one at a time", "session_busy"
            )
        if s.calls and s.calls[-1].sig == req.sig and s.last_body is not None:  # a retry: the record's answer
            count(rnd.stats, "external/retries")
            return 200, s.last_body
        return 200, await _answer(rnd, s, req)
    except ApiError as exc:
        count(rnd.stats, "external/bad_requests" if exc.status < 409 else "external/refused_requests")
        if exc.status == 409 and key in rnd.sessions and rnd.sessions[key].failure is None:
            rnd.sessions[key].failure = f"context mismatch: {exc.message}"
            count(rnd.stats, "external/context_mismatch")
        return exc.status, exc.payload()
    except Exception as exc:  # the engine failed: the round fails with it once the harness is done
        log.exception("the agent endpoint failed on a request of session %s", key)
        rnd.error = rnd.error or exc
        return 500, ApiError(
            500, f"the sampler failed: {type(exc).__name__}: {exc}", "server_error"
        ).payload()


async def _answer(rnd: Round, s: Session, req: ChatRequest) -> dict[str, Any]:
    """The session's next call, one at a time; a re-send while it runs waits for this answer."""
    s.busy = True
    answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    s.inflight = (req.sig, answer)
    try:
        body = await take_turn(rnd, s, req)
        s.last_body = body
        answer.set_result(body)
        return body
    except Exception as exc:
        # the messages are the harness's: a template that cannot render them is a 400
        error = ApiError(400, f"messages: {exc}", param="messages") if isinstance(exc, ProtocolError) else exc
        answer.set_exception(error)
        answer.exception()  # retrieved: a retry waiting on it re-raises it, none waiting is no warning
        if error is exc:
            raise
        raise error from None
    finally:
        if not answer.done():
            answer.cancel()
        s.busy, s.inflight = False, None


async def take_turn(rnd: Round, s: Session, req: ChatRequest) -> dict[str, Any]:
    """The session's next call for this request (module docstring)."""
    kind, conv = route(s, req) if s.convs else ("new", None)
    changed_from = None
    if kind == "tool_change":
        assert conv is not None
        if rnd.tool_change == "refuse":
            count(rnd.stats, "external/tool_changes_refused")
            raise conversation_tools_changed(conv)
        count(rnd.stats, "external/tool_changes")
        log.info(
            "session %s: tools changed on conversation %d: a new context (env.tool_change)", s.key, conv.index
        )
        changed_from, conv = conv.index, None
    if conv is not None:
        new, context = await _extend(rnd, conv, req)
    else:
        context = await _open(rnd, s, req)
    try:
        recorded = s.replay.answer(context) if s.replay is not None else None
    except ReplayMismatch as exc:
        raise ApiError(409, str(exc), "context_mismatch") from None
    if conv is None:
        conv = _new_conversation(s, req, context, changed_from)
    else:
        conv.turns[-1].obs_messages, conv.turns[-1].obs_ids = new, context[len(conv.context) :]
        conv.context = context
    call = len(s.calls)
    if recorded is not None:
        turn = recorded.turn.replayed()
    else:
        key, parent_key = conv.key, conv.parent_key
        turn = await generate(rnd, context, req, key, parent_key, mix_seed(s.seed, call))
        conv.parent_key = conv.key
    parent = conv.calls[-1] if conv.calls else None
    s.calls.append(Call(conv.index, parent, context, req.sig, recorded is not None))
    conv.turns.append(turn)
    conv.calls.append(call)
    conv.context = [*context, *turn.ids]
    if turn.finish_reason != "stop":
        conv.finish = "truncated"  # a cut turn cannot be continued: its conversation ends (as the own loop)
    extra = {"conversation": conv.index, "call": call, "parent_call": parent}
    usage = (len(context), len(turn.ids))
    return body_of(rnd, s.key, len(conv.turns) - 1, turn, req, recorded is not None, usage, extra)


def _too_long(rnd: Round, req: ChatRequest, messages: list[dict[str, Any]], room: int) -> bool:
    """The cheap bound: these messages' text needs more tokens than `room`, whatever the tokenizer does."""
    chars = sum(len(m.get("content") or "") for m in messages if m["role"] != "assistant")
    return chars // rnd.templates.max_token_chars >= room


async def _open(rnd: Round, s: Session, req: ChatRequest) -> list[int]:
    """A new conversation's prompt ids; the session's first is the tree's prompt (checked against it)."""
    budget, first = rnd.limits.token_budget, not s.convs
    if _too_long(rnd, req, req.messages, budget - req.tools_chars // rnd.templates.max_token_chars):
        ids = None
    else:
        ids = await asyncio.to_thread(rnd.templates.prompt_ids, req.messages, req.tools)
    if ids is None or len(ids) >= budget:  # no room for one token: refused, never sent to the engine
        size = "more than the budget" if ids is None else f"{len(ids)} tokens"
        why = f"the prompt is {size}: env.token_budget ({budget}) leaves no room for a turn"
        if first:
            s.failure = why
            count(rnd.stats, "external/prompt_too_long")
        raise ApiError(
            400, f"{why}{'; the episode is over' if first else ''}", "context_length_exceeded", "messages"
        )
    if first:
        _check_tree_prompt(s, req, ids)
    return ids


def _check_tree_prompt(s: Session, req: ChatRequest, ids: list[int]) -> None:
    tree = s.tree
    if tree.prompt is None and s.replay is None:
        tree.prompt = Prompt(req.messages, req.tools, ids)
        return
    assert tree.prompt is not None
    if req.tools != tree.prompt.tools:
        raise ApiError(
            409, "tools differ from the ones this tree's episodes started with", "context_mismatch"
        )
    why = first_difference(req.messages, tree.prompt.messages)
    if why is not None or len(req.messages) != len(tree.prompt.messages) or ids != tree.prompt.ids:
        why = why or "the first messages differ from this tree's prompt"
        raise ApiError(409, f"{why} (every episode of a tree starts from its prompt)", "context_mismatch")


async def _extend(rnd: Round, conv: Conversation, req: ChatRequest) -> tuple[list[dict[str, Any]], list[int]]:
    """(the new messages, the context ids for the conversation's next turn); a limit ends it (400)."""
    if conv.finish is not None:
        why = f"conversation {conv.index} ended ({conv.finish}): open a new one"
        raise ApiError(400, why, "max_turns" if conv.finish == "max_turns" else "session_ended")
    new = req.messages[len(conv.recorded()) :]
    if any(m["role"] == "assistant" for m in new):
        why = "the request must add tool or user messages after the last assistant turn, and no assistant one"
        raise ApiError(409, why, "context_mismatch")
    limits = rnd.limits
    if len(conv.turns) >= limits.max_turns:
        conv.finish = "max_turns"
        raise ApiError(400, f"conversation {conv.index} reached env.max_turns: it is over", "max_turns")
    room = limits.token_budget - len(conv.context)
    delta = (
        None
        if _too_long(rnd, req, new, room)
        else await asyncio.to_thread(rnd.templates.delta_ids, new, conv.turns[-1].ids)
    )
    if delta is None or len(delta) >= room:
        conv.finish = "token_budget"
        why = f"conversation {conv.index}: the context reached env.token_budget ({limits.token_budget})"
        raise ApiError(400, f"{why}: it is over", "context_length_exceeded")
    return new, [*conv.context, *delta]


def _new_conversation(s: Session, req: ChatRequest, ids: list[int], changed_from: int | None) -> Conversation:
    index = len(s.convs)
    key = s.key if index == 0 else f"{s.key}/c{index}"
    conv = Conversation(index, key, req.messages, req.tools, ids, len(s.calls), s.trunk_keys.get(index))
    conv.tool_change_of, conv.context = changed_from, ids
    s.convs.append(conv)
    return conv


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
