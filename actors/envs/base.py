"""Tasks, step results and the ``Environment`` protocol the agent loop talks to.

Usage by an agent loop (one episode)::

    env = make_env("synthetic_kb")
    messages = [system(env.system_prompt()), user(env.user_prompt(task))]
    calls: list[ToolCall] = []
    for turn in range(env.max_turns):
        text = policy(messages)
        res = env.step(task, calls, text)
        if res.call is not None:
            calls.append(res.call)
        if res.done:
            break                      # res.reward is final; res.info["finish"] says why
        messages += [assistant(text), tool(res.observation)]
    else:
        res = env.max_turns_result()   # the loop, not the env, enforces max_turns

Determinism: tools are pure functions of their call, so ``step`` depends only on ``(task, action_text)``
(and the history, which our envs accept but do not need). Branching a rollout tree from an anchor turn
therefore needs only that prefix's calls; nothing has to be copied. ``snapshot``/``restore`` exist for
symmetry with stateful envs and are no-ops here. An outside, stateful environment (``env.name = gym``,
actors/envs/gym) offers no snapshot either: its adapter keeps live instances keyed by the history and
rebuilds a branch's state by replaying the prefix's actions, checked against what was stored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from actors.envs.rewards import exact_match, f1
from actors.envs.tool_calls import ParseError, ToolCall, parse_tool_call

FINISH_ANSWER = "answer"  # the policy called the answer tool
FINISH_MALFORMED = "malformed"  # the turn held no tool call at all
FINISH_MAX_TURNS = "max_turns"  # set by the loop through max_turns_result()


@dataclass(frozen=True)
class Task:
    """One task. Our own environments read a question and its golds: ``answers`` holds every accepted gold
    string (EM/F1 take the max over them). An outside environment (``env.name = gym``, actors/envs/gym)
    reads what it was written for instead: ``messages``, the prompt as chat messages, and ``record``, the
    task's own record as its ecosystem gave it (a SkyRL dataset row, a verifiers task's data). ``task_id``
    is stable across runs and samplers: outside environments' instances and observations are keyed by it.
    """

    task_id: str
    question: str
    answers: tuple[str, ...]
    dataset: str
    meta: dict[str, Any] = field(default_factory=dict, hash=False)
    messages: tuple[dict[str, Any], ...] = field(default=(), hash=False, compare=False)
    record: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class StepResult:
    """What one assistant turn produced.

    observation: text for the next ``tool`` message, or None when the episode is done.
    reward: the final reward when done, else None. call: the parsed call (None if unparseable).
    info: always has "finish" (None while running); also "turn", and "error"/"em"/"f1" where relevant. An
    outside environment adds "messages" (the observation as chat messages, rendered by their roles) and,
    on a done result, "drop" (why the episode must not be trained on: its branch is removed from the
    tree, actors/tree_sampler.py).
    """

    observation: str | None
    done: bool
    reward: float | None
    call: ToolCall | None
    info: dict[str, Any] = field(default_factory=dict, hash=False)


@runtime_checkable
class Environment(Protocol):
    """What the agent loop needs from a task family. Implementations never raise on model output."""

    name: str
    max_turns: int

    def system_prompt(self) -> str: ...

    def user_prompt(self, task: Task) -> str: ...

    def step(self, task: Task, history: Sequence[ToolCall], action_text: str) -> StepResult: ...

    def reward(self, task: Task, answer_text: str) -> float: ...

    def snapshot(self) -> object: ...

    def restore(self, snapshot: object) -> None: ...

    def metrics(self) -> dict[str, float]:
        """Counters the sampler's metrics add, e.g. ``env/retrieval_errors``; empty where there are none."""
        ...


class EnvFailure(Exception):
    """An environment failed on one task (raised in reset or step, a non-finite reward, a lost worker).
    The message is one line naming the environment and the task id; the agent loop logs it as it is and
    ends the episode as a verifier error (`algo.on_verifier_error`), and the run goes on."""


class ToolError(Exception):
    """Raised by a tool for bad arguments or a failed lookup; the env turns it into an observation."""


@dataclass(frozen=True)
class Tool:
    """A pure tool taking one string argument ``arg`` (e.g. search(query), open(docid))."""

    name: str
    description: str
    arg: str
    fn: Callable[[str], str]

    def schema(self) -> dict[str, Any]:
        """OpenAI/Qwen function schema, for chat templates that take ``tools=``."""
        props = {self.arg: {"type": "string"}}
        params = {"type": "object", "properties": props, "required": [self.arg]}
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }


def _answer_tool() -> Tool:
    def never_called(_: str) -> str:  # the env handles "answer" itself: it ends the episode
        raise AssertionError("answer is handled by ToolEnv.step")

    return Tool("answer", "Give the final answer and end the episode.", "answer", never_called)


class ToolEnv:
    """Shared step logic: parse the turn, dispatch to a tool, map every failure to an observation.

    Subclasses only supply tools, prompts and (optionally) a reward; state is immutable after __init__.
    """

    name = "tool_env"

    def __init__(self, tools: Sequence[Tool], system_prompt: str, max_turns: int) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self._tools: dict[str, Tool] = {t.name: t for t in [*tools, _answer_tool()]}
        self._plain_args: Mapping[str, str] = {t.name: t.arg for t in self._tools.values()}
        self._system_prompt = system_prompt
        self.max_turns = max_turns

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    @property
    def plain_args(self) -> Mapping[str, str]:
        """Tool name -> its one argument's name (for parsers of other action protocols)."""
        return self._plain_args

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self._tools.values()]

    def system_prompt(self) -> str:
        return self._system_prompt

    def user_prompt(self, task: Task) -> str:
        return task.question

    def reward(self, task: Task, answer_text: str) -> float:
        return exact_match(answer_text, task.answers)

    def snapshot(self) -> object:
        return None  # stateless: a branch only needs the prefix's calls

    def restore(self, snapshot: object) -> None:
        return None

    def metrics(self) -> dict[str, float]:
        """Counters of the search backend, e.g. ``env/retrieval_errors`` of a retrieval-service client."""
        index = getattr(self, "index", None)
        return dict(index.metrics()) if hasattr(index, "metrics") else {}

    def max_turns_result(self) -> StepResult:
        """The terminal result the loop records when the policy used up max_turns without answering."""
        return StepResult(None, True, 0.0, None, {"finish": FINISH_MAX_TURNS})

    def step(self, task: Task, history: Sequence[ToolCall], action_text: str) -> StepResult:
        return self.step_parsed(task, history, parse_tool_call(action_text, self._plain_args))

    def step_parsed(
        self, task: Task, history: Sequence[ToolCall], parsed: ToolCall | ParseError
    ) -> StepResult:
        """`step` after parsing: an agent protocol (actors/protocols) parses the turn its own way."""
        turn = len(history) + 1
        if isinstance(parsed, ParseError):
            if not parsed.attempted:
                info = {"finish": FINISH_MALFORMED, "turn": turn, "error": parsed.reason}
                return StepResult(None, True, 0.0, None, info)
            return self._continue(f"error: {parsed.reason}", None, turn, "malformed_call")
        tool = self._tools.get(parsed.name)
        if tool is None:
            avail = ", ".join(self._tools)
            return self._continue(
                f"error: unknown tool '{parsed.name}'; available: {avail}", parsed, turn, "unknown_tool"
            )
        value = parsed.arguments.get(tool.arg)
        if not isinstance(value, str) or not value.strip():
            msg = f"error: {tool.name} needs a non-empty string argument '{tool.arg}'"
            return self._continue(msg, parsed, turn, "bad_arguments")
        if tool.name == "answer":
            return self._finish_answer(task, parsed, value.strip(), turn)
        try:
            observation = tool.fn(value.strip())
        except ToolError as exc:
            return self._continue(f"error: {exc}", parsed, turn, "tool_error")
        return StepResult(observation, False, None, parsed, {"finish": None, "turn": turn})

    def _continue(self, observation: str, call: ToolCall | None, turn: int, error: str) -> StepResult:
        return StepResult(observation, False, None, call, {"finish": None, "turn": turn, "error": error})

    def _finish_answer(self, task: Task, call: ToolCall, answer: str, turn: int) -> StepResult:
        reward = self.reward(task, answer)
        info = {
            "finish": FINISH_ANSWER,
            "turn": turn,
            "answer": answer,
            "em": exact_match(answer, task.answers),
            "f1": f1(answer, task.answers),
        }
        return StepResult(None, True, reward, call, info)
