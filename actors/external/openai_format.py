"""The OpenAI chat-completions wire format of the external-agent endpoint, with no state and no I/O:

    req = parse_chat_request(body, SamplingBounds(1.0, 1.0))   # ApiError(400, "... naming the field")
    content, calls = split_turn(text, starts_inside_think)     # `<tool_call>` JSON → OpenAI tool_calls
    body = completion_body(message, "tool_calls", ...)         # what the client parses

Messages are normalized (text parts joined, tool-call arguments parsed) so that the harness's echo of the
conversation can be compared with what the endpoint recorded and returned: `same_message`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
# fields a request may carry; any other is refused (400 naming it) rather than silently ignored (`user`,
# `metadata`, `store`: accepted and ignored, as frameworks set them)
FIELDS = {
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "stream",
    "n", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "user", "metadata", "store",
    "stream_options",
}  # fmt: skip
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


class ApiError(Exception):
    """An HTTP error with OpenAI's JSON body: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str = ""
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def payload(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param or None, "code": None}
        }


@dataclass(frozen=True)
class SamplingBounds:
    """What the run samples with (`sampler.temperature`, `sampler.top_p`): a request may restate it only."""

    temperature: float
    top_p: float


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # normalized (`normalize_message`)
    tools: list[dict[str, Any]]
    max_tokens: int | None
    logprobs: bool
    model: str
    parallel_tool_calls: bool = True  # false: at most one tool call per assistant turn
    sig: str = ""  # what a re-send of the same request has too (a client's retry): its messages and tools
    tools_chars: int = 0  # the tool schemas' length as JSON (the cheap bound on a prompt's tokens)


def bad(field: str, why: str) -> ApiError:
    return ApiError(400, f"{field}: {why}", param=field)


def parse_chat_request(body: Any, bounds: SamplingBounds) -> ChatRequest:
    """The request checked field by field; the first problem is an ApiError naming its field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad(
            unknown[0],
            "not supported by this endpoint (it samples for training: see docs/external-agents.md)",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "a non-empty list of messages is required")
    msgs = [normalize_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    check_tool_answers(msgs)
    _check_sampling(body, bounds)
    tools = _tools(body.get("tools"))
    return ChatRequest(
        messages=msgs,
        tools=tools,
        max_tokens=_max_tokens(body),
        logprobs=_flag(body, "logprobs"),
        model=str(body.get("model") or ""),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        sig=signature(msgs, tools),
        tools_chars=len(json.dumps(tools)) if tools else 0,
    )


def signature(msgs: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """A digest of the messages and tools: equal for a re-send of the same request. The contents are hashed
    as they are (sha256 releases the GIL on large buffers), not dumped as JSON: a huge prompt costs little."""
    h = hashlib.sha256(json.dumps(tools, sort_keys=True).encode())
    for m in msgs:
        content = m["content"].encode(errors="surrogatepass")
        head = {k: v for k, v in m.items() if k != "content"}
        h.update(f"\0{json.dumps(head, sort_keys=True)}\0{len(content)}\0".encode())
        h.update(content)
    return h.hexdigest()


def _check_sampling(body: dict[str, Any], bounds: SamplingBounds) -> None:
    for name, run_value, key in (
        ("temperature", bounds.temperature, "sampler.temperature"),
        ("top_p", bounds.top_p, "sampler.top_p"),
    ):
        value = body.get(name)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isclose(value, run_value)
        ):
            raise bad(name, f"{value!r} is not allowed: this run samples at {name} {run_value} ({key})")
    _flag(body, "stream")  # true: the same turn, sent as server-sent events (streaming.py)
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or any(
        k != "include_usage" or type(v) is not bool for k, v in options.items()
    ):
        raise bad("stream_options", f'expected {{"include_usage": true or false}}, got {options!r}')
    if body.get("n") not in (None, 1):
        raise bad("n", "only n=1 is served (a tree's branches come from separate sessions)")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("top_logprobs", "alternatives are not returned; use logprobs=true for the sampled tokens")
    if body.get("tool_choice") not in (None, "auto"):
        raise bad("tool_choice", "only 'auto' (the model decides) can be honoured by sampling")
    _flag(body, "parallel_tool_calls")


def check_tool_answers(msgs: list[dict[str, Any]]) -> None:
    """Every tool message answers a call of the last assistant message before it, by `tool_call_id`, and
    each call is answered once: else a 400 naming the message's `tool_call_id`."""
    open_calls: set[str] = set()
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            open_calls = {c["id"] for c in m.get("tool_calls", []) if isinstance(c["id"], str)}
        elif m["role"] == "tool":
            cid = m.get("tool_call_id")
            if cid not in open_calls:
                calls = ", ".join(sorted(open_calls)) or "none left unanswered"
                what = f"{cid!r} answers no tool call" if cid else "missing: say which tool call this answers"
                why = f"{what} (the calls of the assistant message before it: {calls})"
                raise bad(f"messages[{i}].tool_call_id", why)
            open_calls.discard(cid)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(name, f"expected true or false, got {value!r}")
    return bool(value)


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(name, f"expected a positive integer, got {value!r}")
        return int(value)
    return None


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools", "expected a list of function tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}]", 'expected {"type": "function", "function": {"name": ...}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}].function.name", "a non-empty string is required")
    return list(tools)


def normalize_message(m: Any, where: str) -> dict[str, Any]:
    """A message as {role, content (text), [tool_calls], [tool_call_id], [name]}: what the template renders
    and what two conversations are compared by."""
    if not isinstance(m, dict):
        raise bad(where, "expected a message object")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"expected one of {ROLES}, got {role!r}")
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(f"{where}[{j}]", "only text parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(where, "expected a string, null or a list of text parts")


def _call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(where, 'expected {"id": ..., "type": "function", "function": {"name", "arguments"}}')
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):  # else kept as text: compared as text
            args = json.loads(args)
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Normalized messages equal (for an assistant message: content and tool calls, ids included)."""
    return a == b


def first_difference(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> str | None:
    """Where `got` stops extending `want` (None: it extends it): the message index and what differs."""
    for i, w in enumerate(want):
        if i >= len(got):
            return f"the request has {len(got)} messages, the recorded conversation {len(want)}"
        if not same_message(got[i], w):
            keys = sorted(k for k in {*got[i], *w} if got[i].get(k) != w.get(k))
            return f"messages[{i}] ({w['role']}) differs from the recorded one in {', '.join(keys)}"
    return None


def reasoning_spans(text: str, starts_inside: bool) -> list[tuple[int, int]]:
    """(start, end) of the turn's reasoning: the prefix up to the first `</think>` when the generation prompt
    opened one, then every `<think>…</think>` block (an unterminated one runs to the end)."""
    spans, offset = [], 0
    if starts_inside:
        end = text.find("</think>")
        offset = len(text) if end < 0 else end + len("</think>")
        spans.append((0, offset))
    spans += [(m.start(), m.end()) for m in _THINK.finditer(text, offset)]
    return spans


def split_turn(
    text: str, starts_inside: bool = False, max_calls: int | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """A sampled turn's text as OpenAI's (content, tool_calls): every `<tool_call>{"name", "arguments"}`
    block outside the reasoning that parses becomes a call (and leaves the content), up to `max_calls`
    (`parallel_tool_calls=false`: 1; later blocks stay text); the rest, reasoning included, is the content.
    Tool calls get fresh ids."""
    spans = reasoning_spans(text, starts_inside)
    calls, cut = [], []
    for m in _TOOL_CALL.finditer(text):
        if max_calls is not None and len(calls) >= max_calls:
            break
        if any(a <= m.start() < b for a, b in spans):
            continue
        try:
            obj = json.loads(m.group(1).strip())
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        fn = {"name": obj["name"], "arguments": arguments}
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": fn})
        cut.append((m.start(), m.end()))
    content = text
    for a, b in reversed(cut):
        content = content[:a] + content[b:]
    return content.strip(), calls


def assistant_message(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The message returned to the harness (which it sends back with the next request)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def completion_body(
    message: dict[str, Any],
    finish_reason: str,
    usage: tuple[int, int],
    model: str,
    logprobs: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    prompt, completion = usage
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": None if logprobs is None else {"content": logprobs},
    }
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        **({"treeopsd": extra} if extra else {}),
    }
