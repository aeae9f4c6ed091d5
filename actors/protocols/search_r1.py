"""The Search-R1 protocol: tags inside one running assistant message::

    <think> … </think>
    <search> Tavo Mirel mentor </search>          the turn stops at </search>
    <information>Doc 1(Title: …) …</information>   appended as plain text after the sampled ids
    <answer> Quinto </answer>                     the turn stops at </answer>; the episode ends

Every tool of the environment is a tag of its name (`<open> docid </open>` for deep research). The
observation is `\\n\\n<information>{result}</information>\\n\\n` right after the sampled ids (Search-R1's
rendering); when the turn ended with the end-of-turn token instead, the result goes into the template's
tool message, so a new assistant turn opens after it. Tags inside `<think>…</think>` are not calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.envs.tool_calls import ParseError, ToolCall, tag_block
from actors.protocols.base import AgentProtocol

SYSTEM_PROMPT = (
    "Answer the given question. Think inside <think> and </think> whenever you get new information. "
    "To look something up, write <search> query </search>: the results come back between <information> and "
    "</information>. Search as often as you need. {extra}When you know the answer, write it inside "
    "<answer> and </answer> without explanation, for example <answer> Beijing </answer>."
)
OPEN_HINT = "To read a document from the results, write <open> docid </open>. "


class SearchR1Protocol(AgentProtocol):
    name = "search_r1"

    def _tags(self) -> dict[str, str]:
        args = dict(getattr(self.env, "plain_args", None) or {"search": "query", "answer": "answer"})
        return {name: arg for name, arg in args.items()}

    def closers(self) -> tuple[str, ...]:
        return tuple(f"</{name}>" for name in self._tags())

    def system_prompt(self, env: Any) -> str:
        return SYSTEM_PROMPT.format(extra=OPEN_HINT if "open" in self._tags() else "")

    def parse(self, text: str) -> ToolCall | ParseError:
        body = self.visible(text)
        found = {name: body.find(f"<{name}>") for name in self._tags()}
        found = {name: pos for name, pos in found.items() if pos >= 0}
        if not found:
            tags = " or ".join(f"<{n}>…</{n}>" for n in self._tags())
            return ParseError(f"no {tags} outside the reasoning", False, body.strip())
        name = min(found, key=lambda n: found[n])
        content, raw = tag_block(body, found[name], f"<{name}>", f"</{name}>")
        return ToolCall(name, {self._tags()[name]: content}, raw)

    def action_text(self, call: ToolCall) -> str:
        return f"<{call.name}> {next(iter(call.arguments.values()), '')} </{call.name}>"

    def observation_tokens(self, observation: str, turn: Sequence[int] | None = None) -> list[int]:
        info = f"<information>{observation}</information>"
        if turn is not None and self.turn_closed(turn):
            r = self.rendering
            return self.encode(r.before + info + r.after)
        return self.encode(f"\n\n{info}\n\n")
