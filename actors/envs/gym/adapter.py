"""`env.name = gym`: an outside, stateful text environment (SkyRL-gym, OpenEnv, verifiers) as our
`Environment`, grown into rollout trees without changing it.

    env = GymEnv(make_host("skyrl_gym:make", {"id": "gsm8k_multi_turn"}), "skyrl_gym:make", max_turns=3)
    tasks = env.tasks("gsm8k.jsonl")            # or the ecosystem's own (a verifiers taskset's)
    env.prompt_messages(tasks[0])               # built and reset once: the tree's prompt
    env.step(task, history, action_text)        # history: the calls this env returned on the path so far

Our own environments are pure, so a branch restores its anchor's state by passing the prefix's calls. An
outside environment keeps state, so this adapter keeps its live instances in a pool keyed by (task id,
hash of the actions so far), and what each step returned in a cache under the same key:

- a step whose key is cached is answered from the cache: a warm tree replays without calling the tools;
- otherwise the instance standing at the parent key steps (the trunks, turn after turn), and when none
  stands there (a branch: its trunk's instance has moved on; or one the pool evicted) a new one is built,
  reset with the task and made to **replay the prefix's actions**, each replayed step checked against the
  cache: a different observation, reward or end is counted (`env/replay_mismatch`) and the episode ends
  with a "drop" reason; the sampler removes that branch from its tree (a trunk: the tree), so nothing is
  trained on an observation the environment would not give again.

A leaf's reward is the return of its path (the sum of the steps' rewards; a verifiers task's score). An
episode the environment does not end by `max_turns` is cut there, with one line per task. An environment
that raises in reset or step, or returns a non-finite reward, fails the episode with one line naming the
task (`EnvFailure`: the loop treats it as a verifier error); the run goes on. The instances of a task are
closed when its trees are stored (`close_tasks`); the pool holds at most `pool_size`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from actors.envs.base import EnvFailure, StepResult, Task
from actors.envs.gym.factory import one_line
from actors.envs.gym.hosts import HostError
from actors.envs.gym.pool import LRU, Key, Outcome, history_key
from actors.envs.gym.tasks import load_records, task_from_record
from actors.envs.tool_calls import ParseError, ToolCall

log = logging.getLogger(__name__)

COUNTERS = (
    "env/steps",
    "env/cache_hits",
    "env/instances_opened",
    "env/replays",
    "env/replayed_steps",
    "env/replay_mismatch",
    "env/errors",
    "env/nonfinite_rewards",
    "env/max_turns",
)


@dataclass
class Live:
    """A live instance (the host's handle) and the return of the path it has walked."""

    handle: Any
    ret: float


class Dropped(Exception):
    """A replay that did not reproduce the stored path; the message is the reason the episode is dropped."""


def action_payload(text: str, parsed: ToolCall | ParseError | None) -> dict[str, Any]:
    """What the environment is given for a turn: its text, and the call the agent protocol read in it (a
    tool-calling environment's action; a text environment parses the text itself)."""
    if isinstance(parsed, ToolCall):
        return {"text": text, "call": {"name": parsed.name, "arguments": parsed.arguments}, "error": None}
    error = parsed.reason if isinstance(parsed, ParseError) and parsed.attempted else None
    return {"text": text, "call": None, "error": error}


class GymEnv:
    name = "gym"
    takes_text = True  # ProtocolEnv gives it the turn's text (and the protocol's parse), not a parsed call
    inline_tools = False  # outside tools may block: the sampler runs them in its thread pool

    def __init__(
        self,
        host: Any,
        factory: str,
        max_turns: int = 6,
        pool_size: int = 64,
        cache_size: int = 20000,
        mismatch_max: float = 0.0,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.host, self.factory, self.max_turns = host, factory, max_turns
        self.mismatch_max = mismatch_max
        self.pool: LRU[Live] = LRU(pool_size, on_evict=self._discard)
        self.cache: LRU[Outcome] = LRU(cache_size)
        self.prompts: dict[str, list[dict[str, Any]]] = {}
        self._tools: list[dict[str, Any]] | None = None
        self._lock = threading.Lock()
        self.stats = dict.fromkeys(COUNTERS, 0.0)
        self._per_task: dict[str, list[int]] = {}  # task id -> [replays, mismatches]
        self._warned: set[tuple[str, str]] = set()

    # ---- what the sampler and the agent protocol read ----------------------------------------------
    def tasks(self, path: str | None = None, dataset: str = "gym") -> list[Task]:
        """The ecosystem's own tasks (a verifiers taskset), else the records of `path` (env.data)."""
        own = self.host.tasks()
        if own is not None:
            return [task_from_record(r, i, dataset) for i, r in enumerate(own)]
        if path is None:
            raise ValueError(
                f"env.data must name a task file for env.factory = {self.factory} (one record a line)"
            )
        return [task_from_record(r, i, dataset) for i, r in enumerate(load_records(path))]

    def tool_schemas(self) -> list[dict[str, Any]]:
        if self._tools is None:
            self._tools = self.host.tools()
        return list(self._tools)

    @property
    def plain_args(self) -> dict[str, str]:
        """Tool name -> its first argument (the plain protocol's `name: value` lines), and `answer`."""
        out = {"answer": "answer"}
        for t in self.tool_schemas():
            params = t["function"].get("parameters") or {}
            names = list(params.get("required") or params.get("properties") or [])
            out[t["function"]["name"]] = names[0] if names else "input"
        return out

    def system_prompt(self) -> str:
        return ""  # the prompt is the task's messages (prompt_messages)

    def user_prompt(self, task: Task) -> str:
        return task.question

    def reward(self, task: Task, answer_text: str) -> float:
        return 0.0  # rewards come from the environment's own steps

    def snapshot(self) -> object:
        return None  # the pool and the replay stand in for snapshots

    def restore(self, snapshot: object) -> None:
        return None

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = dict(self.stats)
        out["env/instances_live"] = float(len(self.pool))
        replays = out["env/replays"]
        out["env/replay_mismatch_frac"] = out["env/replay_mismatch"] / replays if replays else 0.0
        return out

    def max_turns_result(self) -> StepResult:
        return StepResult(None, True, 0.0, None, {"finish": "max_turns"})

    # ---- the prompt ---------------------------------------------------------------------------------
    def prompt_messages(self, task: Task) -> list[dict[str, Any]]:
        """The messages the tree starts from: the environment built and reset for `task` (that instance
        waits in the pool for the first trajectory). Raises EnvFailure when the reset fails."""
        prompt = self.prompts.get(task.task_id)
        if prompt is None:
            live = self._open(task)
            self.pool.put(history_key(task.task_id, ()), live)
            prompt = self.prompts[task.task_id]
        return list(prompt)

    def _open(self, task: Task) -> Live:
        record = {"task_id": task.task_id, "messages": list(task.messages), "record": dict(task.record)}
        try:
            handle, prompt = self.host.open(record)
        except Exception as exc:
            raise self._failure(task, "reset", exc) from None
        self._count("env/instances_opened")
        known = self.prompts.setdefault(task.task_id, prompt)
        if known != prompt:
            self._discard(Live(handle, 0.0))
            raise Dropped(self._mismatch(task, 0, "the reset gave another prompt than before"))
        return Live(handle, 0.0)

    # ---- a step -------------------------------------------------------------------------------------
    def step(
        self,
        task: Task,
        history: Sequence[ToolCall],
        action_text: str,
        parsed: ToolCall | ParseError | None = None,
    ) -> StepResult:
        payload = action_payload(action_text, parsed)
        actions = [dict(c.arguments["action"]) for c in history]
        texts = [a["text"] for a in actions]
        turn = len(actions) + 1
        key = history_key(task.task_id, [*texts, action_text])
        outcome = self.cache.get(key)
        if outcome is not None:
            self._count("env/cache_hits")
        else:
            try:
                outcome = self._advance(task, actions, key, payload, turn)
            except Dropped as d:
                return StepResult(
                    None, True, 0.0, None, {"finish": "replay_mismatch", "turn": turn, "drop": str(d)}
                )
        return self._result(task, outcome, turn, payload)

    def _advance(
        self, task: Task, actions: list[dict[str, Any]], key: Key, payload: dict[str, Any], turn: int
    ) -> Outcome:
        prev = history_key(task.task_id, [a["text"] for a in actions])
        live = self.pool.take(prev) or self._rebuild(task, actions)
        outcome = self._step_live(task, live, payload, turn)
        if not outcome.done and turn >= self.max_turns:  # cut here: its score, where the env gives one
            try:
                score = self.host.finish(live.handle)
            except Exception as exc:
                self._discard(live)
                raise self._failure(task, "scoring the cut episode", exc, turn) from None
            ret = outcome.ret if score is None else self._finite(task, score, turn)
            outcome = Outcome(
                outcome.observation, outcome.messages, outcome.reward, False, ret, {"cut": True}
            )
        self.cache.put(key, outcome)
        if outcome.done or turn >= self.max_turns:
            self._discard(live)
        else:
            self.pool.put(key, live)
        return outcome

    def _step_live(self, task: Task, live: Live, payload: Mapping[str, Any], turn: int) -> Outcome:
        """One step of a live instance (it moves on: `live.ret` becomes the new return)."""
        try:
            raw = self.host.step(live.handle, payload)
        except Exception as exc:
            self._discard(live)
            raise self._failure(task, "step", exc, turn) from None
        self._count("env/steps")
        try:
            reward = self._finite(task, raw.get("reward"), turn)
        except EnvFailure:
            self._discard(live)
            raise
        live.ret += reward
        messages = tuple(dict(m) for m in raw.get("messages") or ())
        return Outcome(
            str(raw.get("observation") or ""),
            messages,
            reward,
            bool(raw.get("done")),
            live.ret,
            raw.get("info") or {},
        )

    def _rebuild(self, task: Task, actions: list[dict[str, Any]]) -> Live:
        """A new instance for `task`, reset, made to replay `actions`; each step checked against the cache."""
        live = self._open(task)
        for i, action in enumerate(actions):
            outcome = self._step_live(task, live, action, i + 1)
            self._count("env/replayed_steps")
            key = history_key(task.task_id, [a["text"] for a in actions[: i + 1]])
            stored = self.cache.get(key)
            ended_early = outcome.done and i + 1 < len(actions)
            if ended_early or (stored is not None and not outcome.same_as(stored)):
                self._discard(live)
                self._tally(task, mismatched=True)
                got = f"{outcome.observation[:60]!r} (reward {outcome.reward}, done {outcome.done})"
                was = (
                    ""
                    if stored is None
                    else f", stored {stored.observation[:60]!r} (reward {stored.reward}, done {stored.done})"
                )
                raise Dropped(self._mismatch(task, i + 1, f"replayed turn {i + 1} gave {got}{was}"))
            if stored is None:
                self.cache.put(key, outcome)
        if actions:
            self._tally(task, mismatched=False)
        return live

    def _result(self, task: Task, outcome: Outcome, turn: int, payload: dict[str, Any]) -> StepResult:
        name = payload["call"]["name"] if payload["call"] else "text"
        call = ToolCall(name, {"action": payload}, payload["text"])
        if outcome.done:
            return StepResult(None, True, outcome.ret, call, {"finish": "done", "turn": turn})
        if turn >= self.max_turns:
            self._count("env/max_turns")
            self._warn_once(
                task,
                "max_turns",
                f"the environment did not end its episode within env.max_turns = {self.max_turns} turns; "
                "cut there (env/max_turns)",
            )
            return StepResult(None, True, outcome.ret, call, {"finish": "max_turns", "turn": turn})
        info = {"finish": None, "turn": turn, "messages": [dict(m) for m in outcome.messages]}
        return StepResult(outcome.observation, False, None, call, info)

    # ---- failures, counters, closing ----------------------------------------------------------------
    def _finite(self, task: Task, reward: Any, turn: int) -> float:
        value = 0.0 if reward is None else reward
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self._count("env/nonfinite_rewards")
            raise self._failure(task, "step", ValueError(f"reward {reward!r} is not a finite number"), turn)
        return float(value)

    def _failure(self, task: Task, where: str, exc: BaseException, turn: int | None = None) -> EnvFailure:
        self._count("env/errors")
        cause = str(exc) if isinstance(exc, (HostError, EnvFailure)) else one_line(exc)
        at = "" if turn is None else f" at turn {turn}"
        return EnvFailure(f"env.factory {self.factory} failed in {where} on task {task.task_id}{at}: {cause}")

    def _mismatch(self, task: Task, turn: int, what: str) -> str:
        self._count("env/replay_mismatch")
        replays, mismatches = self._per_task.get(task.task_id, [0, 0])
        frac = mismatches / replays if replays else 1.0
        if frac > self.mismatch_max:
            self._warn_once(
                task,
                "mismatch",
                f"the environment is not deterministic: {mismatches} of {max(replays, 1)} replays differed "
                f"(> env.replay_mismatch_max = {self.mismatch_max}); those branches are dropped",
            )
        return f"replay mismatch on task {task.task_id}: {what}"

    def _tally(self, task: Task, mismatched: bool) -> None:
        with self._lock:
            self.stats["env/replays"] += 1
            tally = self._per_task.setdefault(task.task_id, [0, 0])
            tally[0] += 1
            tally[1] += int(mismatched)

    def _warn_once(self, task: Task, kind: str, text: str) -> None:
        with self._lock:
            if (task.task_id, kind) in self._warned:
                return
            self._warned.add((task.task_id, kind))
        log.warning("env.factory %s: task %s: %s", self.factory, task.task_id, text)

    def _count(self, key: str, by: float = 1.0) -> None:
        with self._lock:
            self.stats[key] += by

    def _discard(self, live: Live) -> None:
        try:
            self.host.close_instance(live.handle)
        except Exception as exc:  # a failed close loses nothing stored
            log.debug("closing an instance of %s raised %s", self.factory, one_line(exc))

    def close_tasks(self, task_ids: Sequence[str]) -> None:
        """Their trees are stored: the live instances of these tasks are closed (the cache stays)."""
        for live in self.pool.take_tasks(task_ids):
            self._discard(live)

    def close(self) -> None:
        for live in self.pool.take_all():
            self._discard(live)
        self.host.close()
