"""The Qwen3 protocol: tool schemas through the chat template's `tools=`, calls as JSON in
`<tool_call>…</tool_call>`, results as the template's tool messages, reasoning in `<think>…</think>`::

    <think> … </think>                                     never parsed (also when the prompt opened it)
    <tool_call>
    {"name": "search", "arguments": {"query": "Tavo Mirel mentor"}}
    </tool_call>                                           the turn stops here (or at the end of turn)

The observation closes the assistant turn when it stopped at `</tool_call>` and renders the tool message
and the next generation prompt as the template does (Qwen3: `<|im_end|>\\n<|im_start|>user\\n
<tool_response>\\n…\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`). The episode ends with a call
of the `answer` tool, an `<answer>…</answer>`, or a final message without a call, whose text (outside the
reasoning) is the answer. A `<tool_call>` inside the reasoning is not executed: the env answers with an
error observation. A template that ignores `tools=` (SmolLM2's) gets the schemas in the system message.
"""

from __future__ import annotations

import json
from typing import Any

from actors.envs.tool_calls import ParseError, ToolCall, parse_json_call, tag_block
from actors.protocols.base import AgentProtocol, call_json, render

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
SYSTEM_PROMPT = (
    "Answer the question. Use the tools as often as you need; when you know the answer, call the answer "
    "tool with a short answer (a few words)."
)
TOOLS_INTRO = "You may call the tools below."  # an outside task's prompt without a system message
# For templates that ignore `tools=`: the schemas and the call format in the system message.
TOOLS_BLOCK = (
    "\n\n# Tools\n\nTo call a function, write one JSON object with its name and arguments between "
    "<tool_call> and </tool_call>, for example:\n<tool_call>\n{example}\n</tool_call>\n\nThe functions "
    "(JSON schemas):\n<tools>\n{schemas}\n</tools>"
)


def system_with_tools(system: str, tools: list[dict[str, Any]]) -> str:
    """`system` with the tool schemas and the call format appended, for a template that ignores `tools=`
    (this protocol's prompt, and an outside harness's through actors/external/render.py)."""
    example = call_json(ToolCall("search", {"query": "..."}))
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return system + TOOLS_BLOCK.format(example=example, schemas=schemas)


def template_handles_tools(tokenizer: Any, tools: list[dict[str, Any]]) -> bool:
    """Whether the chat template renders `tools=` (the `auto` protocol's test, with `<tool_call>` in it)."""
    if not tools or tokenizer.chat_template is None:
        return False
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    return render(tokenizer, msgs, True, tools=tools) != render(tokenizer, msgs, True)


class Qwen3Protocol(AgentProtocol):
    name = "qwen3"
    passes_tools = True

    def __init__(self, tokenizer: Any, env: Any, enable_thinking: bool = True) -> None:
        super().__init__(tokenizer, env, enable_thinking)
        self.template_tools = template_handles_tools(tokenizer, self.tools)

    def closers(self) -> tuple[str, ...]:
        return (TOOL_CLOSE,)

    def system_prompt(self, env: Any) -> str:
        return SYSTEM_PROMPT

    def prompt_messages(self, system: str, user: str) -> list[dict[str, Any]]:
        if self.tools and not self.template_tools:  # the template would drop the schemas
            system = system_with_tools(system, self.tools)
        return super().prompt_messages(system, user)

    def with_tools(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.tools or self.template_tools:
            return messages
        if messages and messages[0]["role"] == "system":
            return [
                {**messages[0], "content": system_with_tools(messages[0]["content"], self.tools)},
                *messages[1:],
            ]
        return [{"role": "system", "content": system_with_tools(TOOLS_INTRO, self.tools)}, *messages]

    def parse(self, text: str) -> ToolCall | ParseError:
        body = self.visible(text)
        call = body.find(TOOL_OPEN)
        if call >= 0:
            return parse_json_call(body, call)
        answer = body.find("<answer>")
        if answer >= 0:
            content, raw = tag_block(body, answer, "<answer>", "</answer>")
            return ToolCall("answer", {"answer": content}, raw)
        if TOOL_OPEN in text:  # only inside the reasoning
            why = "a <tool_call> inside the reasoning (<think>…</think>) is not executed; close it first"
            return ParseError(why, True, text.strip())
        final = body.strip()
        if final:  # a final message without a call: its text is the answer
            return ToolCall("answer", {"answer": final}, final)
        return ParseError("no tool call and no answer outside the reasoning", False, text.strip())

    def action_text(self, call: ToolCall) -> str:
        return f"{TOOL_OPEN}\n{call_json(call)}\n{TOOL_CLOSE}"
