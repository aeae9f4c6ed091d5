"""`stream=true`: a chat completion sent as OpenAI's server-sent events, chunk by chunk.

    for event in sse_events(body, include_usage=False):   # body: what the non-streamed request returns
        ...                                                # "data: {chunk}\\n\\n", then "data: [DONE]\\n\\n"

The turn is sampled (and recorded) exactly as for `stream=false`, then sent as chunks of
`chat.completion.chunk`: the role, the content (with its `logprobs`), the tool calls (each whole, with its
index), the finish reason (with the `treeopsd` record), then the usage when `stream_options.include_usage`.
Assembled by the client, they are the non-streamed message, so the history it sends back extends the
recorded conversation as the non-streamed reply does. The turn is not streamed token by token: it is sent
once sampled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def stream_chunks(body: dict[str, Any], include_usage: bool = False) -> list[dict[str, Any]]:
    """The chunks of the completion `body` (openai_format.completion_body), in order."""
    [choice] = body["choices"]
    message, logprobs = choice["message"], choice["logprobs"]
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None = None, lps: Any = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if message.get("content") or logprobs is not None:
        out.append(chunk({"content": message.get("content") or ""}, lps=logprobs))
    if message.get("tool_calls"):
        calls = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        out.append(chunk({"tool_calls": calls}))
    last = chunk({}, choice["finish_reason"])
    if "treeopsd" in body:
        last["treeopsd"] = body["treeopsd"]
    out.append(last)
    if include_usage:
        out.append({**head, "choices": [], "usage": body["usage"]})
    return out


def sse_events(body: dict[str, Any], include_usage: bool = False) -> Iterator[str]:
    for c in stream_chunks(body, include_usage):
        yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
