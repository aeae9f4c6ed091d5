"""Agents in a process of their own: the run hands its episodes out over HTTP instead of calling a harness.

    treeopsd train env.harness=actors.external.remote:queued env.protocol=qwen3 --run-dir runs/agent
    python examples/remote_agent.py --run-dir runs/agent    # any process, any language: every sampler's
                                                            # endpoint, as RUN_DIR/agent_endpoints.json lists

`queued` is the harness: per episode it offers the task on its endpoint's queue and waits until an agent
finished it. The agent polls `GET /v1/tasks/next` (`{"task": null}` while none waits; else the task's JSON:
`session`, `api_key`, `base_url`, `session_url`, `task_id`, `question`, `answers`, `dataset`, `meta`,
`system_prompt`, `tools`), drives the episode with `base_url` and `api_key` only (the key names the
session), runs the environment's tools by `POST /v1/tools/call` (`{"name", "arguments"}` → `{"content"}`)
and posts its reward (`POST /v1/reward`), which finishes the episode; `POST /v1/tasks/done` finishes one
without a reward (the agent gave up: the episode is dropped, `external/no_reward`). An episode no agent
finishes within `env.harness_timeout_s` is dropped (`external/harness_timeouts`), as a hung harness; one
that no agent takes while no request reaches the endpoint for `env.agent_wait_s` is dropped at once
(`NoAgent`: `external/no_agent`; the run names the sampler no agent serves, runtime/external_tally.py).

Branching replays the episode: the agent must be deterministic given the model's replies (as a harness).
The queue is shared by the endpoint's HTTP thread and the harness threads: one lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.external.openai_format import ApiError

QUEUES: dict[str, TaskQueue] = {}  # a live endpoint's base URL → its queue (AgentEndpoint registers it)
_SHOWN = ("task_id", "question", "answers", "dataset", "meta", "system_prompt", "tools", "api_key")


@dataclass
class _Entry:
    view: dict[str, Any]
    call_tool: Callable[[str, dict[str, Any]], str]
    done: threading.Event = field(default_factory=threading.Event)
    taken: bool = False


class NoAgent(RuntimeError):
    """No agent took the episode: no request reached the endpoint for `env.agent_wait_s`."""


class TaskQueue:
    def __init__(self, base_url: str, wait_s: float, agent_wait_s: float = 10.0) -> None:
        self.base_url, self.wait_s, self.agent_wait_s = base_url, wait_s, agent_wait_s
        self._mu = threading.Lock()
        self._pending: deque[str] = deque()
        self._entries: dict[str, _Entry] = {}
        self.last_seen = time.monotonic()  # the last request of an agent (any route)

    def seen(self) -> None:
        self.last_seen = time.monotonic()

    def unserved(self) -> bool:
        """No agent is around: no request for `agent_wait_s`, and no episode taken and still running (a
        busy agent waiting on a slow tool sends nothing for a while)."""
        if time.monotonic() - self.last_seen <= self.agent_wait_s:
            return False
        with self._mu:
            return not any(e.taken and not e.done.is_set() for e in self._entries.values())

    def offer(self, session: str, task: dict[str, Any]) -> _Entry:
        view = {k: task[k] for k in _SHOWN if k in task}
        view.update(session=session, base_url=self.base_url, session_url=task.get("session_url"))
        entry = _Entry(view, task["call_tool"])
        with self._mu:
            self._entries[session] = entry
            self._pending.append(session)
        return entry

    def take(self) -> dict[str, Any] | None:
        """The oldest task no agent has taken (None: none waits)."""
        with self._mu:
            while self._pending:
                entry = self._entries.get(self._pending.popleft())
                if entry is not None:
                    entry.taken = True
                    return entry.view
        return None

    def call_tool(self, session: str, body: Any) -> dict[str, Any]:
        with self._mu:
            entry = self._entries.get(session)
        if entry is None:
            why = f"session {session!r} has no task handed out (or it is over)"
            raise ApiError(404, why, "not_found_error")
        name = body.get("name") if isinstance(body, dict) else None
        args = body.get("arguments", {}) if isinstance(body, dict) else None
        if not isinstance(name, str) or not isinstance(args, dict):
            raise ApiError(400, "tools/call: expected {'name': str, 'arguments': object}", param="name")
        return {"content": entry.call_tool(name, args)}

    def finish(self, session: str) -> bool:
        with self._mu:
            entry = self._entries.get(session)
        if entry is not None:
            entry.done.set()
        return entry is not None

    def drop(self, session: str) -> None:
        with self._mu:
            self._entries.pop(session, None)


def queued(task: dict[str, Any], base_url: str, session: str) -> None:
    """The harness of an agent in another process: offers the episode, waits until an agent finishes it
    (its reward posted, or `POST /v1/tasks/done`); the reward is the posted one."""
    q = QUEUES.get(base_url)
    if q is None:
        raise RuntimeError(f"no agent endpoint serves {base_url} in this process")
    entry = q.offer(session, task)
    deadline = time.monotonic() + q.wait_s
    try:
        while not entry.done.wait(min(1.0, q.agent_wait_s / 4)):
            if not entry.taken and q.unserved():
                raise NoAgent(
                    f"no agent took the episode: no request reached {q.base_url} for {q.agent_wait_s:g} s "
                    "(env.agent_wait_s): does an agent serve this sampler's endpoint?"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no agent finished the episode within {q.wait_s:g} s (GET /v1/tasks/next)"
                )
    finally:
        q.drop(session)
