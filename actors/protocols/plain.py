"""The plain protocol (the tiny model's, and the default): one call per turn as a line, ending the turn
with the end-of-turn token::

    search: Tavo Mirel mentor
    answer: Quinto

`actors/envs/tool_calls.py:parse_tool_call` reads it (it also takes `<tool_call>` JSON and `<answer>` tags);
the env's own system prompt explains it. With the tiny ChatML tokenizer the ids are exactly those of
`actors/chat.py:ChatFormat`, which the warm-start renders with.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.envs.tool_calls import ParseError, ToolCall, parse_tool_call
from actors.protocols.base import AgentProtocol


class PlainProtocol(AgentProtocol):
    name = "plain"

    def parse(self, text: str) -> ToolCall | ParseError:
        return parse_tool_call(self.visible(text), getattr(self.env, "plain_args", None))

    def action_text(self, call: ToolCall) -> str:
        return f"{call.name}: {next(iter(call.arguments.values()), '')}"

    def decode_turn(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))
