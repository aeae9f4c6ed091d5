"""A verifiers (v1) taskset stepped turn by turn: its tasks, its toolsets as our tool calls, its rubric (the
task's `@vf.reward` functions and judges, `Task.score`) as the reward.

    backend = VerifiersBackend(KBTaskset, "kb_tools.taskset:KBTaskset", {"num_tasks": 4})
    backend.tasks()    # [{"id": task.data.id or task.key, "messages": [system?, user], "record": data}, ...]
    backend.tools()    # OpenAI function schemas of the toolsets' tools, named as verifiers names them
    inst = backend.open({"task_id": ..., ...})
    inst.step({"text": "...", "call": {"name": "kb_search", "arguments": {"query": "x"}}, "error": None})

A turn with a call of a toolset's tool runs it (the toolset's own MCP registration, in this process: the
schemas and the argument validation are verifiers'); its result is the tool message. A turn that calls
`answer`, or makes no call at all, is the final reply: the conversation becomes a `vf.Trace` and the task
scores it. A cut episode (`env.max_turns`) is scored as it stands, as verifiers scores a truncated rollout.
Harness-based environments (a harness that calls a model) are not stepped here: they drive the policy
through the agent endpoint instead (docs/external-agents.md).

Runs in the environment's own Python (`env.python`): verifiers pins `openai<3`, which the trainer's venv
does not have.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from actors.envs.gym.drivers import json_safe, plain_messages, text_of


class VerifiersBackend:
    ecosystem = "verifiers"

    def __init__(self, factory: Any, spec: str, args: Mapping[str, Any]) -> None:
        import verifiers.v1 as vf
        from verifiers.v1.utils.generic import concrete_type

        if isinstance(factory, type) and issubclass(factory, vf.Taskset):
            config_cls = concrete_type(factory, vf.TasksetConfig) or vf.TasksetConfig
            self.taskset = factory(config_cls(**args))
        else:
            self.taskset = factory(**args)
        self.spec, self.loop = spec, asyncio.new_event_loop()
        self.by_id: dict[str, Any] = {}

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def tasks(self) -> list[dict[str, Any]]:
        out = []
        for task in self.taskset:
            task_id = str(task.data.id or task.key)
            self.by_id[task_id] = task
            record = json_safe(task.data.model_dump(mode="json", exclude_none=True))
            out.append({"id": task_id, "messages": prompt_of(task), "record": record})
        return out

    def task(self, task_id: str) -> Any:
        if not self.by_id:
            self.tasks()
        if task_id not in self.by_id:
            raise KeyError(f"the taskset has no task {task_id!r}")
        return self.by_id[task_id]

    def toolsets(self, task: Any) -> list[Any]:
        shared = type(self.taskset).toolsets(self.taskset.config)
        return [*shared, *type(task).toolsets(task.config)]

    def tools(self) -> list[dict[str, Any]]:
        if not self.by_id:
            self.tasks()
        if not self.by_id:
            return []
        servers = self.run(serve(self.toolsets(next(iter(self.by_id.values()))), None))
        return [schema for _, _, schema in servers.values()]

    def open(self, task: Mapping[str, Any]) -> VerifiersInstance:
        return VerifiersInstance(self, self.task(str(task["task_id"])))


async def serve(toolsets: list[Any], task: Any) -> dict[str, tuple[Any, str, dict[str, Any]]]:
    """Each toolset set up (for `task`, when given) and registered on an in-process MCP server, as its tool
    server would register it: full tool name -> (server, the toolset's own name, the OpenAI schema)."""
    from mcp.server.mcpserver import MCPServer

    out = {}
    for ts in toolsets:
        await ts.setup()
        if task is not None:
            await ts.setup_task(task)
        server = MCPServer(ts.server_name or type(ts).__name__)
        ts.register(server)
        for tool in await server.list_tools():
            name = f"{ts.server_name}_{tool.name}" if ts.server_name else tool.name
            fn = {"name": name, "description": tool.description or "", "parameters": tool.input_schema}
            out[name] = (server, tool.name, {"type": "function", "function": fn})
    return out


def prompt_of(task: Any) -> list[dict[str, str]]:
    system = [{"role": "system", "content": task.data.system_prompt}] if task.data.system_prompt else []
    return [*system, *plain_messages(task.data.prompt)]


class VerifiersInstance:
    def __init__(self, backend: VerifiersBackend, task: Any) -> None:
        self.backend, self.task = backend, task
        self.servers = backend.run(serve(backend.toolsets(task), task))
        self.prompt = prompt_of(task)
        self.turns: list[Any] = []  # the conversation after the prompt, as verifiers messages

    def step(self, action: Mapping[str, Any]) -> dict[str, Any]:
        import verifiers.v1 as vf

        call, text = action.get("call"), str(action["text"])
        name = call["name"] if call else None
        if call is None and action.get("error"):  # a malformed call: the model is told, the episode goes on
            return self._observe(vf.AssistantMessage(content=text), None, f"error: {action['error']}")
        if name is None or name == "answer":  # the final reply: scored by the task
            reply = text_of(call["arguments"].get("answer")) if call else text
            self.turns.append(vf.AssistantMessage(content=reply))
            return {"observation": "", "messages": [], "reward": self.finish(), "done": True, "info": {}}
        call_id = f"call_{len(self.turns)}"
        arguments = json.dumps(call.get("arguments") or {}, ensure_ascii=False)
        message = vf.AssistantMessage(
            content=text, tool_calls=[vf.ToolCall(id=call_id, name=name, arguments=arguments)]
        )
        if name not in self.servers:
            return self._observe(
                message, call_id, f"error: unknown tool {name!r}; have {sorted(self.servers)}"
            )
        server, raw, _ = self.servers[name]
        try:
            result = self.backend.run(server.call_tool(raw, dict(call.get("arguments") or {})))
            content = tool_text(result)
        except Exception as exc:  # a tool's error is the model's to read, as a verifiers harness shows it
            content = f"error: {' '.join(str(exc).split())}"
        return self._observe(message, call_id, content)

    def _observe(self, message: Any, call_id: str | None, content: str) -> dict[str, Any]:
        import verifiers.v1 as vf

        self.turns.append(message)
        if call_id is not None:
            self.turns.append(vf.ToolMessage(tool_call_id=call_id, content=content))
        else:
            self.turns.append(vf.UserMessage(content=content))
        role = "tool" if call_id is not None else "user"
        return {
            "observation": content,
            "messages": [{"role": role, "content": content}],
            "reward": 0.0,
            "done": False,
            "info": {},
        }

    def finish(self) -> float:
        """The task's score of the conversation so far (its rewards, weighted, summed: `Trace.reward`)."""
        import verifiers.v1 as vf
        from verifiers.v1.graph import MessageNode

        prompt = [_message(m) for m in self.prompt]
        messages = [*prompt, *self.turns]
        nodes = [
            MessageNode(
                parent=i - 1 if i else None, message=m, sampled=i >= len(prompt) and m.role == "assistant"
            )
            for i, m in enumerate(messages)
        ]
        t = self.task
        trace = vf.Trace(
            task=vf.TraceTask(type=type(t).__name__, data=t.data, key=t.key, hash=t.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
            nodes=nodes,
        )
        self.backend.run(t.score(trace))
        unscored = [k for k, r in trace.rewards.items() if r is None]
        if unscored:
            raise RuntimeError(f"the task's rewards {unscored} returned nothing")
        return float(trace.reward)

    def close(self) -> None:
        self.servers = {}


def _message(m: Mapping[str, str]) -> Any:
    import verifiers.v1 as vf

    cls = {"system": vf.SystemMessage, "user": vf.UserMessage}.get(m["role"], vf.UserMessage)
    return cls(content=m["content"])


def tool_text(result: Any) -> str:
    """An MCP tool result's content as text (text blocks joined by newlines)."""
    blocks = getattr(result, "content", None) or []
    texts = [getattr(b, "text", None) for b in blocks]
    if blocks and all(isinstance(x, str) for x in texts):
        return "\n".join(t for t in texts if t is not None)
    return json.dumps(json_safe([b.model_dump() if hasattr(b, "model_dump") else str(b) for b in blocks]))
