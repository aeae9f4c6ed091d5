"""A search agent in a process of its own: the `openai` client and `urllib` only, no treeopsd import
(docs/external-agents.md, "An agent in its own process"). Start the run, then the agent:

    treeopsd train env.harness=actors.external.remote:queued env.protocol=qwen3 env.agent_port=8100 \\
        sampler.num_samplers=1
    python examples/remote_agent.py --url http://127.0.0.1:8100/v1

It polls `GET /v1/tasks/next` for episodes and drives each with an unmodified client given only
`base_url` and the task's `api_key` (the key names the episode's session). After its first turn it asks the
model for a summary of the episode so far (a side call: another conversation on the same session), and, if
the episode goes on, compacts its history to the question and that summary (a new conversation that the run
records as a linked segment). Tools run in the run (`POST /v1/tools/call`); the reward, exact match against
the task's answers, is posted (`POST /v1/reward`). Deterministic given the model's replies, as branching by
replay needs. Stops after `--idle-exit-s` seconds without a task (or the run's endpoint gone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import string
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from openai import BadRequestError, OpenAI

SUMMARY_PROMPT = "Summarise the conversation below for whoever continues it: what was asked, what was found."


def http(url: str, key: str, body: dict[str, Any] | None = None) -> Any:
    """GET (no body) or POST `body` as JSON with `Authorization: Bearer <key>`; the reply's JSON."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as reply:
        return json.loads(reply.read())


def normalize(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def exact_match(answer: str, answers: list[str]) -> float:
    return float(normalize(answer) in {normalize(a) for a in answers})


def summarise(client: OpenAI, messages: list[dict[str, Any]]) -> str:
    """The side call: a fresh conversation (no tools) about the episode's transcript."""
    transcript = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages[1:])
    try:
        reply = client.chat.completions.create(
            model="policy",
            messages=[{"role": "system", "content": SUMMARY_PROMPT}, {"role": "user", "content": transcript}],
        )
    except BadRequestError:  # e.g. the transcript is over the run's token budget: no summary
        return ""
    text = reply.choices[0].message.content or ""
    return re.sub(r"<think>.*?</think>|<tool_call>.*", "", text, flags=re.S).strip()


def act(base: str, task: dict[str, Any], message: Any) -> tuple[float | None, list[dict[str, Any]]]:
    """(the reward, if the turn ended the episode; else the tool messages answering its calls)."""
    if not message.tool_calls:  # a final message without a call: its text is the answer
        return exact_match(message.content or "", task["answers"]), []
    out = []
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        args = args if isinstance(args, dict) else {}
        if call.function.name == "answer":
            return exact_match(str(args.get("answer", "")), task["answers"]), []
        result = http(f"{base}/tools/call", task["api_key"], {"name": call.function.name, "arguments": args})
        out.append({"role": "tool", "tool_call_id": call.id, "content": result["content"]})
    return None, out


def run_episode(base: str, task: dict[str, Any], max_turns: int = 8, summary_after: int = 1) -> float:
    """One episode, driven with `base_url` and the task's api key only; returns its reward. The summary is
    asked for after turn `summary_after` (or once the episode ended, if sooner)."""
    client = OpenAI(base_url=base, api_key=task["api_key"], max_retries=0)
    system = {"role": "system", "content": task["system_prompt"]}
    messages: list[dict[str, Any]] = [system, {"role": "user", "content": task["question"]}]
    summarised = False
    for turn in range(max_turns):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=task["tools"])
        except BadRequestError:  # the run's turn or token budget is spent: the episode is over
            return 0.0
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))  # sent back exactly as returned
        reward, follow = (0.0, []) if choice.finish_reason == "length" else act(base, task, choice.message)
        messages += follow
        if not summarised and (turn == summary_after or reward is not None):
            summarised = True  # a summary (a side call), then, if the episode goes on, the history compacted
            summary = summarise(client, messages)
            if reward is None:
                messages = [system, {"role": "user", "content": f"{task['question']}\nNotes: {summary}"}]
        if reward is not None:
            return reward
    return 0.0


def work(base: str, key: str, idle_exit_s: float) -> None:
    """Takes tasks until none came for `idle_exit_s` seconds (or the endpoint is gone that long)."""
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < idle_exit_s:
        try:
            task = http(f"{base}/tasks/next", key)["task"]
        except (urllib.error.URLError, ConnectionError):
            task = None
        if task is None:
            time.sleep(0.25)
            continue
        try:
            reward = run_episode(base, task)
            http(f"{base}/reward", task["api_key"], {"reward": reward})
        except Exception as exc:  # this episode only: tell the run, take the next one
            print(f"remote_agent: episode {task['session']} failed: {type(exc).__name__}: {exc}", flush=True)
            with contextlib.suppress(urllib.error.URLError, ConnectionError):
                http(f"{base}/tasks/done", task["api_key"], {})
        idle_since = time.monotonic()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the run's endpoint, http://HOST:PORT/v1")
    p.add_argument("--token", default="none", help="env.agent_token, if the run has one")
    p.add_argument("--workers", type=int, default=4, help="episodes at once")
    p.add_argument("--idle-exit-s", type=float, default=600.0, help="stop after this long without a task")
    a = p.parse_args()
    threads = [
        threading.Thread(target=work, args=(a.url.rstrip("/"), a.token, a.idle_exit_s), daemon=True)
        for _ in range(a.workers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
