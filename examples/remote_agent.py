"""A search agent in a process of its own: the `openai` client and `urllib` only, no treeopsd import
(docs/external-agents.md, "An agent in its own process"). Start the run, then the agent:

    treeopsd train env.harness=actors.external.remote:queued env.protocol=qwen3 --run-dir runs/agent
    python examples/remote_agent.py --run-dir runs/agent    # every sampler's endpoint, as the run lists them

`--run-dir DIR` (or `--endpoints DIR/agent_endpoints.json`) serves every sampler of the run: the file lists
each sampler's base URL, and is re-read every second (a restarted sampler may have another port); `--url
http://HOST:PORT/v1` serves one endpoint (a run of one sampler, or `env.agent_port=P`: sampler i is on P + i).
With `env.agent_token` set, the token comes from `--token` or `$TREEOPSD_AGENT_TOKEN` (never from the file).

It polls `GET /v1/tasks/next` for episodes and drives each with an unmodified client given only
`base_url` and the task's `api_key` (the key names the episode's session and opens it while the episode
runs). After its first turn it asks the model for a summary of the episode so far (another conversation on
the same session), and, if the episode goes on, compacts its history to the question and that summary:
a new conversation with the same system message and tools, which the run records as the episode's
continuation (its turns are branched like any), the summary a turn of the episode when its text is used.
Tools run in the run (`POST /v1/tools/call`); the reward, exact match against the task's answers (the
agent scores itself: the run's `answer` tool returns nothing), is posted (`POST /v1/reward`).
Deterministic given the model's replies, as branching by replay needs. Stops after `--idle-exit-s` seconds
without a task (or with the run's endpoints gone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import string
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from openai import BadRequestError, OpenAI

ENDPOINTS = "agent_endpoints.json"  # in the run's directory: one endpoint per sampler
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


def listed(path: Path) -> set[str]:
    """The base URLs a run's discovery file lists (RUN_DIR/agent_endpoints.json; none while it is missing)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    entries = data.get("endpoints", []) if isinstance(data, dict) else []
    return {
        e["base_url"].rstrip("/")
        for e in entries
        if isinstance(e, dict) and isinstance(e.get("base_url"), str)
    }


class Agent:
    """`workers` threads per endpoint served, each taking that endpoint's tasks one at a time."""

    def __init__(self, key: str, workers: int, idle_exit_s: float) -> None:
        self.key, self.workers, self.idle_exit_s = key, workers, idle_exit_s
        self.urls: frozenset[str] = frozenset()  # the endpoints served now
        self.threads: dict[str, list[threading.Thread]] = {}
        self.stop = threading.Event()
        self.mu = threading.Lock()
        self.busy, self.last_task = 0, time.monotonic()

    def serve(self, urls: set[str]) -> None:
        """Serves `urls`: workers start for a new one; those of an endpoint no longer listed (its sampler
        restarted elsewhere, or closed) stop after their episode."""
        self.urls = frozenset(urls)
        for url in self.urls:
            alive = [t for t in self.threads.get(url, []) if t.is_alive()]
            for _ in range(self.workers - len(alive)):
                alive.append(threading.Thread(target=self.work, args=(url,), daemon=True))
                alive[-1].start()
            self.threads[url] = alive

    def idle(self) -> bool:
        """No episode running, and none taken for `idle_exit_s` seconds (or no endpoint answered)."""
        with self.mu:
            return self.busy == 0 and time.monotonic() - self.last_task > self.idle_exit_s

    def work(self, base: str) -> None:
        while not self.stop.is_set() and base in self.urls:
            try:
                task = http(f"{base}/tasks/next", self.key)["task"]
            except (urllib.error.URLError, OSError):  # not up yet, or gone: no task
                task = None
            if task is None:
                time.sleep(0.25)
                continue
            with self.mu:
                self.busy += 1
            try:
                episode(base, task)
            finally:
                with self.mu:
                    self.busy, self.last_task = self.busy - 1, time.monotonic()

    def join(self, timeout_s: float = 30.0) -> None:
        self.stop.set()
        for t in (t for ts in self.threads.values() for t in ts):
            t.join(timeout=timeout_s)


def episode(base: str, task: dict[str, Any]) -> None:
    """One task: the episode, its reward posted; a failure tells the run (`POST /v1/tasks/done`)."""
    try:
        reward = run_episode(base, task)
        http(f"{base}/reward", task["api_key"], {"reward": reward})
    except Exception as exc:  # this episode only: tell the run, take the next one
        print(f"remote_agent: episode {task['session']} failed: {type(exc).__name__}: {exc}", flush=True)
        with contextlib.suppress(urllib.error.URLError, OSError):
            http(f"{base}/tasks/done", task["api_key"], {})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="one endpoint, http://HOST:PORT/v1 (a run of one sampler)")
    where.add_argument(
        "--endpoints", help="a run's discovery file, RUN_DIR/agent_endpoints.json: every sampler"
    )
    where.add_argument("--run-dir", help="the run's directory (its agent_endpoints.json)")
    token = os.environ.get("TREEOPSD_AGENT_TOKEN") or "none"
    p.add_argument(
        "--token", default=token, help="env.agent_token, if the run has one ($TREEOPSD_AGENT_TOKEN)"
    )
    p.add_argument("--workers", type=int, default=4, help="episodes at once, per endpoint")
    p.add_argument("--idle-exit-s", type=float, default=600.0, help="stop after this long without a task")
    a = p.parse_args()
    found = Path(a.endpoints) if a.endpoints else Path(a.run_dir) / ENDPOINTS if a.run_dir else None
    agent = Agent(a.token, a.workers, a.idle_exit_s)
    while not agent.idle():
        agent.serve(listed(found) if found is not None else {a.url.rstrip("/")})  # re-read: samplers restart
        time.sleep(1.0)
    agent.join()


if __name__ == "__main__":
    main()
