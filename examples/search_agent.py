"""A ReAct-style search agent written against the plain `openai` client: the harness of README's "Train your
own agent" (docs/external-agents.md). Train it with

    treeopsd train env.harness=examples.search_agent:run_episode env.protocol=qwen3

Each call runs one episode: the model searches the task's corpus through the tool the task carries
(`task["call_tool"]`: the environment's in-process search, or the shared retrieval service with
`env.retriever=service`) until it answers; the reward is exact match against the task's answers. The
endpoint records every turn token-in/token-out; this file never sees a token id.
"""

from __future__ import annotations

import json
from typing import Any

from openai import BadRequestError, OpenAI

from actors.envs.rewards import exact_match


def run_episode(task: dict[str, Any], base_url: str, session: str, max_turns: int = 8) -> float:
    client = OpenAI(base_url=base_url, api_key=task["api_key"], default_headers={"X-Session-Id": session})
    messages: list[Any] = [
        {"role": "system", "content": task["system_prompt"]},
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=task["tools"])
        except BadRequestError:  # the run's turn or token budget is spent: the episode is over
            return 0.0
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))  # sent back exactly as returned
        if choice.finish_reason == "length":  # a cut turn ends the episode
            return 0.0
        if not choice.message.tool_calls:  # a final message without a call: its text is the answer
            return exact_match(choice.message.content or "", task["answers"])
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)  # type: ignore[union-attr]
            args = args if isinstance(args, dict) else {}
            if call.function.name == "answer":  # type: ignore[union-attr]
                return exact_match(str(args.get("answer", "")), task["answers"])
            result = task["call_tool"](call.function.name, args)  # type: ignore[union-attr]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
