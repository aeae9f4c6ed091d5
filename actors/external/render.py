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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from actors.protocols.base import AgentProtocol, render
from actors.protocols.qwen3 import system_with_tools, template_handles_tools

_SENTINEL = "<<TREEOPSD_EXTERNAL_TURN>>"
_BASE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


class Templates:
    def __init__(self, protocol: AgentProtocol) -> None:
        self.protocol = protocol
        self.tokenizer = protocol.tokenizer
        self.kwargs = dict(protocol.template_kwargs)
        self.stop_token_ids = protocol.stop_token_ids
        self.stop_strings = protocol.stop_strings
        self.opens_think = protocol.rendering.opens_think
        self._tools_rendered: dict[str, bool] = {}

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        kwargs = dict(self.kwargs)
        if tools and self._renders_tools(tools):
            kwargs["tools"] = tools
        elif tools:
            messages = with_tools_in_system(messages, tools)
        text = render(self.tokenizer, [template_message(m) for m in messages], True, **kwargs)
        return self.protocol.encode(text)

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

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each sampled token's own text (for the response's `logprobs`; never encoded again)."""
        return [str(self.tokenizer.decode([int(i)], skip_special_tokens=False)) for i in ids]


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A normalized message as chat templates expect it (tool-call arguments as objects)."""
    return {k: v for k, v in m.items() if v is not None}


def with_tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The qwen3 protocol's fallback: the schemas and the call format appended to the system message."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": system_with_tools(messages[0]["content"], tools)}, *messages[1:]]
    return [{"role": "system", "content": system_with_tools("", tools).lstrip()}, *messages]
