"""Parse one assistant turn into a tool call, for both action protocols the agents use.

Plain lines (the tiny-model protocol)::

    search: Tavo Mirel mentor
    open: doc-123
    answer: Quinto

Qwen3 / Hermes style JSON (``</tool_call>`` may be missing because it is usually a stop string)::

    <tool_call>{"name": "search", "arguments": {"query": "Tavo Mirel mentor"}}</tool_call>
    <answer>Quinto</answer>

``<think>...</think>`` blocks are ignored. The first call in the turn wins.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Default plain-line argument names; envs pass their own mapping (tool name -> argument name).
PLAIN_ARGS: dict[str, str] = {"search": "query", "open": "docid", "answer": "answer"}
# Argument key for a plain line whose tool name the env does not know (it is reported as unknown anyway).
UNKNOWN_ARG = "text"

_THINK_RE = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_TOOL_OPEN, _TOOL_CLOSE = "<tool_call>", "</tool_call>"
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
# "name: rest of line"; the name is one identifier so prose such as "Step 1: ..." is not a call.
_PLAIN_RE = re.compile(r"^[ \t>*`-]*([A-Za-z_][A-Za-z0-9_-]{0,31})[ \t]*:[ \t]*(.*?)[ \t]*$", re.MULTILINE)


@dataclass(frozen=True)
class ToolCall:
    """A parsed call. ``raw`` is the exact substring of the turn that produced it."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict, hash=False)
    raw: str = ""


@dataclass(frozen=True)
class ParseError:
    """Why a turn could not be turned into a call.

    ``attempted`` is True when the turn clearly tried to call a tool (a ``<tool_call>`` block) but got the
    syntax wrong: the env answers with an error observation and the episode goes on. When False the turn
    contains no call at all, which ends the episode (finish "malformed").
    """

    reason: str
    attempted: bool
    raw: str = ""


def strip_think(text: str) -> str:
    """Drop ``<think>`` blocks (an unterminated one runs to the end of the turn)."""
    return _THINK_RE.sub("", text)


def parse_tool_call(text: str, plain_args: Mapping[str, str] | None = None) -> ToolCall | ParseError:
    """Parse the first tool call of an assistant turn; never raises."""
    plain_args = PLAIN_ARGS if plain_args is None else plain_args
    body = strip_think(text)
    starts = {
        "json": body.find(_TOOL_OPEN),
        "answer": body.find(_ANSWER_OPEN),
    }
    found = {kind: pos for kind, pos in starts.items() if pos >= 0}
    if found:
        kind = min(found, key=lambda k: found[k])
        if kind == "json":
            return parse_json_call(body, found[kind])
        return _parse_answer_tag(body, found[kind])
    return _parse_plain(body, plain_args)


def tag_block(body: str, start: int, open_tag: str, close_tag: str) -> tuple[str, str]:
    """Content of a tag block and its raw text; a missing close tag means "to the end of the turn"."""
    inner_start = start + len(open_tag)
    end = body.find(close_tag, inner_start)
    if end < 0:
        return body[inner_start:].strip(), body[start:]
    return body[inner_start:end].strip(), body[start : end + len(close_tag)]


def _parse_answer_tag(body: str, start: int) -> ToolCall:
    content, raw = tag_block(body, start, _ANSWER_OPEN, _ANSWER_CLOSE)
    return ToolCall("answer", {"answer": content}, raw)


def parse_json_call(body: str, start: int) -> ToolCall | ParseError:
    content, raw = tag_block(body, start, _TOOL_OPEN, _TOOL_CLOSE)
    try:
        obj = json.loads(content)
    except json.JSONDecodeError as exc:
        return ParseError(f"invalid JSON in <tool_call>: {exc.msg} at char {exc.pos}", True, raw)
    except RecursionError:  # a sampled run of thousands of "[" or "{": a bad call, not a verifier error
        return ParseError("invalid JSON in <tool_call>: nested too deeply", True, raw)
    if not isinstance(obj, dict):
        return ParseError(f"<tool_call> must hold a JSON object, got {type(obj).__name__}", True, raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ParseError('<tool_call> needs a string "name"', True, raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models string-encode the arguments object
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ParseError(f'"arguments" is a string that is not JSON: {exc.msg}', True, raw)
    if not isinstance(args, dict):
        return ParseError(f'"arguments" must be a JSON object, got {type(args).__name__}', True, raw)
    return ToolCall(name.strip(), args, raw)


def _parse_plain(body: str, plain_args: Mapping[str, str]) -> ToolCall | ParseError:
    first_unknown: re.Match[str] | None = None
    for match in _PLAIN_RE.finditer(body):
        name = match.group(1).lower()
        if name in plain_args:
            return ToolCall(name, {plain_args[name]: match.group(2)}, match.group(0).strip())
        first_unknown = first_unknown or match
    if first_unknown is not None:  # looks like a call to a tool we do not have: report it, don't end
        name = first_unknown.group(1).lower()
        return ToolCall(name, {UNKNOWN_ARG: first_unknown.group(2)}, first_unknown.group(0).strip())
    return ParseError("no tool call found", False, body.strip())
