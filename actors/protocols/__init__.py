"""Agent protocols: how a model writes tool calls and sees their results (`env.protocol`).

    protocol, env = bind_protocol(cfg.env, tokenizer, build_env(cfg))
    run_episodes(episodes, backend, env, protocol, limits)      # the loop sees only this interface

- `plain`: a `search: query` line per turn; results in the template's tool message; stops at end of turn.
- `qwen3`: `<tool_call>{"name": …, "arguments": {…}}</tool_call>` with the schemas given via `tools=`;
  results in the template's tool message; stops at `</tool_call>` or end of turn.
- `search_r1`: `<search> query </search>`, `<answer> … </answer>`; results as `<information>…</information>`
  in the same message; stops at `</search>`, `</answer>` or end of turn.

`auto` picks `qwen3` when the tokenizer's chat template renders `tools=`, else `plain`. The interface is
`actors/protocols/base.py:AgentProtocol`; `ProtocolEnv` is the environment as the agent sees it: the
protocol's system prompt, its parser, and the `env.require_search` gate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from actors.envs.base import FINISH_ANSWER, StepResult, Task
from actors.envs.tool_calls import ToolCall
from actors.protocols.base import AgentProtocol, ProtocolError
from actors.protocols.plain import PlainProtocol
from actors.protocols.qwen3 import Qwen3Protocol, template_handles_tools
from actors.protocols.search_r1 import SearchR1Protocol

PROTOCOLS: dict[str, type[AgentProtocol]] = {
    "plain": PlainProtocol,
    "qwen3": Qwen3Protocol,
    "search_r1": SearchR1Protocol,
}

__all__ = ["PROTOCOLS", "AgentProtocol", "ProtocolEnv", "ProtocolError", "bind_protocol", "make_protocol"]


def resolve_name(name: str, tokenizer: Any, env: Any) -> str:
    """`auto` → qwen3 when the chat template renders the env's tool schemas, else plain."""
    if name != "auto":
        return name
    tools = list(env.tool_schemas()) if hasattr(env, "tool_schemas") else []
    return "qwen3" if template_handles_tools(tokenizer, tools) else "plain"


def make_protocol(name: str, tokenizer: Any, env: Any, enable_thinking: bool = True) -> AgentProtocol:
    name = resolve_name(name, tokenizer, env)
    if name not in PROTOCOLS:
        raise ProtocolError(f"env.protocol = {name!r}: unknown; use one of {(*PROTOCOLS, 'auto')}")
    return PROTOCOLS[name](tokenizer, env, enable_thinking)


class ProtocolEnv:
    """The environment under a protocol: its system prompt and parser; with `reward="f1"` an answer earns
    its token F1 instead of the env's reward (partial credit: a sparse EM gives most trees no contrast);
    an answer before any search call gets reward 0 with `require_search` (EM/F1 are still reported).
    Everything else is the env's."""

    def __init__(
        self, env: Any, protocol: AgentProtocol, require_search: bool = False, reward: str = "em"
    ) -> None:
        self.env, self.protocol, self.require_search, self.reward_kind = env, protocol, require_search, reward

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not set yet (copy/unpickle make the object first): no endless recursion
            raise AttributeError(name)
        return getattr(self.env, name)

    def system_prompt(self) -> str:
        return self.protocol.system_prompt(self.env)

    def user_prompt(self, task: Task) -> str:
        return str(self.env.user_prompt(task))

    def step(self, task: Task, history: Sequence[ToolCall], action_text: str) -> StepResult:
        if getattr(self.env, "takes_text", False):  # an outside env (actors/envs/gym): the text and the parse
            out: StepResult = self.env.step(task, history, action_text, self.protocol.parse(action_text))
            return out
        result: StepResult = self.env.step_parsed(task, history, self.protocol.parse(action_text))
        if self.reward_kind == "f1" and "f1" in result.info:
            result = replace(result, reward=float(result.info["f1"]))
        if (
            self.require_search
            and result.info.get("finish") == FINISH_ANSWER
            and not any(c.name == "search" for c in history)
        ):
            result = replace(result, reward=0.0, info={**result.info, "gated": "no_search"})
        return result


def bind_protocol(
    env_cfg: Any, tokenizer: Any, env: Any, evaluation: bool = False
) -> tuple[AgentProtocol, ProtocolEnv]:
    """The configured protocol (`env.protocol`, `env.enable_thinking`) for this tokenizer and env, and the
    env wrapped for it (`env.require_search`, `env.reward`). An evaluation scores answers by EM whatever
    the training reward, so success means the same in every run."""
    protocol = make_protocol(env_cfg.protocol, tokenizer, env, env_cfg.enable_thinking)
    reward = "em" if evaluation else env_cfg.reward
    return protocol, ProtocolEnv(env, protocol, env_cfg.require_search, reward)
