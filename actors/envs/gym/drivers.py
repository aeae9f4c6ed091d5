"""Instances of SkyRL-gym and OpenEnv environments behind one small interface, which the adapter drives.

    backend = SkyRLBackend(skyrl_gym.make, "skyrl_gym:make", {"id": "gsm8k_multi_turn"})
    inst = backend.open({"task_id": "q1", "messages": [...], "record": row})   # built and reset
    inst.prompt                                        # the messages the model starts from
    out = inst.step({"text": "… #### 72", "call": None, "error": None})
    out == {"observation": "…", "messages": [...], "reward": 0.04, "done": False, "info": {}}
    inst.finish()      # the reward of an episode the run cut at env.max_turns (None: the return so far)
    inst.close()

What each ecosystem's pieces become (docs/environments.md):

- SkyRL-gym (`BaseTextEnv`): the factory is called per task with `extras=` the task's record (a SkyRL
  dataset row: `prompt`, `reward_spec`, `extra_info`, …) and `env_config=` from the factory arguments (a
  mapping, given to the env as an OmegaConf DictConfig as SkyRL does); `init(prompt)` gives the prompt;
  `step(text)` gives `observations` (chat messages, rendered by their roles), `reward`, `done`.
- OpenEnv (`Environment`): the factory is called with its arguments; `reset()` gives the first
  observation (a user message after the task's own prompt messages, if any); a turn becomes the action
  class's one text field (`env.action_field` to choose); an observation's text is its one text field
  (`env.observation_field` to choose) or, with several, its fields as JSON; `reward` and `done` are its own.

Stdlib only (plus the ecosystem itself, imported by the factory): a worker in another Python runs this too.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping
from typing import Any

OBS_EXCLUDE = ("done", "reward", "metadata")


def text_of(content: Any) -> str:
    """A chat message's content as text (a list of parts: their text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def plain_messages(messages: Any) -> list[dict[str, str]]:
    """Messages as {"role", "content"} with text content (a bare string: one user message)."""
    if messages is None:
        return []
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    out = []
    for m in messages:
        m = m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        out.append({"role": str(m.get("role", "user")), "content": text_of(m.get("content"))})
    return out


def json_safe(value: Any) -> Any:
    """`value` as plain JSON data (what cannot be encoded becomes its str)."""
    return json.loads(json.dumps(value, default=str))


class SkyRLBackend:
    ecosystem = "skyrl"

    def __init__(self, factory: Any, spec: str, args: Mapping[str, Any]) -> None:
        self.factory, self.spec, self.args = factory, spec, dict(args)

    def tasks(self) -> list[dict[str, Any]] | None:
        return None  # SkyRL-gym tasks are dataset rows: env.data

    def tools(self) -> list[dict[str, Any]]:
        return []  # a text env parses its own actions

    def open(self, task: Mapping[str, Any]) -> SkyRLInstance:
        kwargs = dict(self.args)
        if isinstance(kwargs.get("env_config"), Mapping):
            from omegaconf import OmegaConf  # skyrl-gym's own dependency; its envs read attributes

            kwargs["env_config"] = OmegaConf.create(dict(kwargs["env_config"]))
        env = self.factory(**kwargs, extras=dict(task.get("record") or {}))
        return SkyRLInstance(env, list(task.get("messages") or []))


class SkyRLInstance:
    def __init__(self, env: Any, messages: list[dict[str, Any]]) -> None:
        self.env = env
        prompt, _ = env.init(messages)
        self.prompt = plain_messages(prompt)

    def step(self, action: Mapping[str, Any]) -> dict[str, Any]:
        out = self.env.step(action["text"])
        messages = plain_messages(out.get("observations") or [])
        return {
            "observation": "\n".join(m["content"] for m in messages),
            "messages": messages,
            "reward": out.get("reward"),
            "done": bool(out.get("done")),
            "info": json_safe(out.get("metadata") or {}),
        }

    def finish(self) -> float | None:
        return None

    def close(self) -> None:
        self.env.close()


class OpenEnvBackend:
    ecosystem = "openenv"

    def __init__(self, factory: Any, spec: str, args: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        self.factory, self.spec, self.args = factory, spec, dict(args)
        self.action_field = options.get("action_field")
        self.observation_field = options.get("observation_field")

    def tasks(self) -> list[dict[str, Any]] | None:
        return None

    def tools(self) -> list[dict[str, Any]]:
        return []

    def open(self, task: Mapping[str, Any]) -> OpenEnvInstance:
        env = self.factory(**self.args)
        return OpenEnvInstance(env, self, task)


def action_class(env: Any) -> Any:
    """The pydantic Action class `env.step` takes (its `action` parameter's annotation)."""
    hints = typing.get_type_hints(type(env).step)
    cls = hints.get("action")
    if not isinstance(cls, type) or not hasattr(cls, "model_fields"):
        raise TypeError(f"{type(env).__name__}.step has no pydantic Action annotation on its 'action'")
    return cls


def text_field(cls: Any, chosen: str | None, what: str) -> str:
    """The one required str field of an Action class (or the chosen one)."""
    if chosen is not None:
        if chosen not in cls.model_fields:
            raise TypeError(f"{what} = {chosen!r}: {cls.__name__} has fields {sorted(cls.model_fields)}")
        return chosen
    names = [n for n, f in cls.model_fields.items() if f.is_required() and f.annotation is str]
    if len(names) != 1:
        raise TypeError(f"{cls.__name__} has required text fields {names}: set {what} to one of them")
    return names[0]


class OpenEnvInstance:
    def __init__(self, env: Any, backend: OpenEnvBackend, task: Mapping[str, Any]) -> None:
        self.env, self.backend = env, backend
        self.action_cls = action_class(env)
        self.field = text_field(self.action_cls, backend.action_field, "env.action_field")
        record = task.get("record") or {}
        obs = env.reset(**dict(record.get("reset_kwargs") or {}))
        first = self._text(obs)
        self.prompt = [
            *plain_messages(task.get("messages")),
            *([{"role": "user", "content": first}] * bool(first)),
        ]

    def _text(self, obs: Any) -> str:
        data = obs.model_dump(mode="json", exclude=set(OBS_EXCLUDE))
        if self.backend.observation_field is not None:
            return text_of(data.get(self.backend.observation_field))
        texts = [v for v in data.values() if isinstance(v, str)]
        return texts[0] if len(texts) == 1 else json.dumps(data, sort_keys=True)

    def step(self, action: Mapping[str, Any]) -> dict[str, Any]:
        obs = self.env.step(self.action_cls(**{self.field: action["text"]}))
        text = self._text(obs)
        return {
            "observation": text,
            "messages": [{"role": "user", "content": text}],
            "reward": obs.reward,
            "done": bool(obs.done),
            "info": json_safe(obs.metadata or {}),
        }

    def finish(self) -> float | None:
        return None

    def close(self) -> None:
        self.env.close()
