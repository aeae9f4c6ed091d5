"""Token ids for a conversation driven from outside, as the project's own loop makes them (actors/protocols):

    t = Templates(protocol)                      # the run's AgentProtocol (qwen3: `<tool_call>` JSON)
    ids = t.prompt_ids(messages, tools)          # the template's rendering of the first messages
    obs = t.delta_ids(new_messages, turn_ids)    # what the template appends after a sampled turn

The prompt is the template's own rendering of the request's first messages with `tools=` (a template that
ignores `tools=` gets the schemas in the system message, as the qwen3 protocol does). After a turn only the
*delta* is rendered: [system, user, assistant SENTINEL] + the new messages, with the generation prompt; the
text after SENTINEL minus the end-of-turn marker is the delta, with the marker in front when the sampled
turn did not end with it (a stop at `</tool_call>`). History is never re-rendered, the sampled ids are never
re-tokenized: a template that drops earlier `<think>` blocks cannot change what was sampled.

`token_bytes` gives each sampled token's raw bytes (for the response's `logprobs`): a byte-level BPE token
(GPT-2, Qwen) through the byte table, a sentencepiece byte token (`<0xE6>`) as its byte, an added token as
its text; a token that splits a character keeps its bytes (`日` = e6 97 a5 over three tokens).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from actors.protocols.base import AgentProtocol, render
from actors.protocols.qwen3 import system_with_tools, template_handles_tools

_SENTINEL = "<<TREEOPSD_EXTERNAL_TURN>>"
_BASE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


class Templates:
    def __init__(self, protocol: AgentProtocol) -> None:
        self.protocol = protocol
        self.tokenizer = protocol.tokenizer
        self.kwargs = dict(protocol.template_kwargs)
        self.stop_token_ids = protocol.stop_token_ids
        self.stop_strings = protocol.stop_strings
        self.opens_think = protocol.rendering.opens_think
        self._tools_rendered: dict[str, bool] = {}
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        self._added = {int(i): str(t) for i, t in added.items()}
        self._bytes = byte_decoder(self.tokenizer)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        kwargs = dict(self.kwargs)
        if tools and self._renders_tools(tools):
            kwargs["tools"] = tools
        elif tools:
            messages = with_tools_in_system(messages, tools)
        text = render(self.tokenizer, [template_message(m) for m in messages], True, **kwargs)
        return self.protocol.encode(text)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its vocabulary entry's length bounds its text's):
        a text of C characters needs at least C // this many tokens, whatever the tokenizer does."""
        vocab = self.tokenizer.get_vocab()
        return max(1, max((len(piece) for piece in vocab), default=1))

    def _renders_tools(self, tools: list[dict[str, Any]]) -> bool:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._tools_rendered:
            self._tools_rendered[key] = template_handles_tools(self.tokenizer, tools)
        return self._tools_rendered[key]

    def delta_ids(self, new: list[dict[str, Any]], turn: Sequence[int]) -> list[int]:
        """Ids of the messages that follow the sampled `turn` and the next generation prompt."""
        msgs = [*_BASE, {"role": "assistant", "content": _SENTINEL}, *(template_message(m) for m in new)]
        text = render(self.tokenizer, msgs, True, **self.kwargs).split(_SENTINEL, 1)[1]
        eot = self.protocol.rendering.end_of_turn
        if not text.startswith(eot):
            raise ValueError(f"the chat template does not close an assistant turn with {eot!r}")
        lead = "" if self.protocol.turn_closed(turn) else eot
        return self.protocol.encode(lead + text[len(eot) :])

    def decode(self, turn: Sequence[int]) -> str:
        """The sampled turn's text, without its final stop token (for parsing only, never re-encoded)."""
        return self.protocol.decode_turn(turn)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each sampled token's raw bytes (for the response's `logprobs`; never encoded again)."""
        return [self._one_token_bytes(int(i)) for i in ids]

    def _one_token_bytes(self, i: int) -> bytes:
        if i in self._added:
            return self._added[i].encode()
        piece = str(self.tokenizer.convert_ids_to_tokens(i))
        if self._bytes is not None and all(c in self._bytes for c in piece):
            return bytes(self._bytes[c] for c in piece)
        if m := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return str(self.tokenizer.decode([i], skip_special_tokens=False)).encode()


def byte_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's byte table (unicode character → byte) when the tokenizer decodes byte-level, else None."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None or b"ByteLevel" not in decoder.__getstate__():
        return None
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: b for b in shown}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in table.items()}


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A normalized message as chat templates expect it (tool-call arguments as objects)."""
    return {k: v for k, v in m.items() if v is not None}


def with_tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The qwen3 protocol's fallback: the schemas and the call format appended to the system message."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": system_with_tools(messages[0]["content"], tools)}, *messages[1:]]
    return [{"role": "system", "content": system_with_tools("", tools).lstrip()}, *messages]
