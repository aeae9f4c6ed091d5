"""What every agent protocol shares: the chat template's rendering of the prompt and of an observation, the
turn's stops, reasoning (`<think>`) handling, and `AgentProtocol`, the one interface the agent loop uses.

Token-in/token-out. The prompt is the template's own rendering of [system, user] (with `tools=` where the
protocol passes tool schemas, and `enable_thinking`) plus the generation prompt. After that, the context
only grows: the sampled ids exactly as sampled, then each observation's ids. An observation is rendered as
the template's *delta*: render [system, user, assistant SENTINEL_A, tool SENTINEL_O] with the generation
prompt, take the text after SENTINEL_A, which is

    end_of_turn + before + SENTINEL_O + after          (ChatML: "<|im_end|>" "\\n<|im_start|>tool\\n" … )

and encode `before + obs + after`, with `end_of_turn` in front when the sampled turn did not end with it
(a stop at `</tool_call>` or `</search>`). These are the ids the template would produce after the sampled
ids; the model's text is never re-tokenized and the history is never re-rendered.

Reasoning: text inside `<think>…</think>` is never parsed as a call or an answer, including the reasoning a
template opens in the generation prompt (Qwen3-Thinking-2507 ends it with "<think>\\n": the turn then starts
inside the reasoning, up to its first `</think>`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from actors.envs.tool_calls import ParseError, ToolCall, strip_think
from actors.protocols.direct_encode import direct_encoder

_SENTINEL = "<<TREEOPSD_OBS>>"
_ASSISTANT = "<<TREEOPSD_ASSISTANT>>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ProtocolError(ValueError):
    """A tokenizer or chat template that cannot carry this protocol; the message says why."""


@dataclass(frozen=True)
class Rendering:
    """The template's pieces around an observation, found once per tokenizer (see the module docstring)."""

    end_of_turn: str  # the text that closes an assistant turn (the eos token in ChatML)
    before: str
    after: str
    opens_think: bool  # the generation prompt leaves a <think> block open


def render(tokenizer: Any, messages: list[dict[str, Any]], generation: bool, **kwargs: Any) -> str:
    """The chat template's text for `messages` (kwargs: `tools=`, `enable_thinking=`)."""
    try:
        return str(
            tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation, **kwargs
            )
        )
    except Exception as exc:  # jinja errors of templates that reject a role or an argument
        raise ProtocolError(f"the tokenizer's chat template failed: {exc}") from exc


def find_rendering(tokenizer: Any, tool_role: str = "tool", **kwargs: Any) -> Rendering:
    """`Rendering` of this tokenizer's template (kwargs go to the template, e.g. enable_thinking)."""
    if tokenizer.chat_template is None:
        raise ProtocolError("the tokenizer has no chat template (multi-turn rollouts need one)")
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    turn = [*base, {"role": "assistant", "content": _ASSISTANT}, {"role": tool_role, "content": _SENTINEL}]
    text = render(tokenizer, turn, True, **kwargs)
    if _ASSISTANT not in text or _SENTINEL not in text:
        raise ProtocolError("the chat template drops the assistant or tool message's content")
    after_turn = text.split(_ASSISTANT, 1)[1]
    eot = end_of_turn_marker(tokenizer, after_turn)
    before, after = after_turn[len(eot) :].split(_SENTINEL, 1)
    prompt = render(tokenizer, base, True, **kwargs)[len(render(tokenizer, base, False, **kwargs)) :]
    return Rendering(eot, before, after, opens_reasoning(prompt))


def end_of_turn_marker(tokenizer: Any, after_turn: str) -> str:
    """The token that ends an assistant turn: the eos token, or the special token the template writes
    there (Qwen3 base models: eos `<|endoftext|>`, turns end with `<|im_end|>`)."""
    eos = tokenizer.eos_token
    if eos and after_turn.startswith(eos):
        return str(eos)
    specials = sorted((str(t) for t in getattr(tokenizer, "all_special_tokens", [])), key=len, reverse=True)
    for token in specials:
        if after_turn.startswith(token):
            return token
    raise ProtocolError(
        f"the chat template does not end an assistant turn with a special token: {after_turn!r}"
    )


def opens_reasoning(text: str) -> bool:
    """Whether `text` leaves a `<think>` block open (its last <think> comes after its last </think>)."""
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)


def outside_reasoning(text: str, starts_inside: bool) -> str:
    """The turn's text with its reasoning removed: the prefix up to the first `</think>` when the turn
    starts inside reasoning (none of it when that never closes), then every `<think>` block (an
    unterminated one runs to the end of the turn)."""
    if starts_inside:
        end = text.find(THINK_CLOSE)
        if end < 0:
            return ""
        text = text[end + len(THINK_CLOSE) :]
    return strip_think(text)


def stops_for(tokenizer: Any, closers: Sequence[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Stop ids for closers that are one token of the vocabulary (Qwen3's `</tool_call>`), stop strings for
    the others (they are matched on the decoded text: `SampleRequest.stop_strings`)."""
    ids, strings = [], []
    for closer in closers:
        enc = tokenizer.encode(closer, add_special_tokens=False)
        if len(enc) == 1 and tokenizer.convert_tokens_to_ids(closer) == enc[0]:
            ids.append(int(enc[0]))
        else:
            strings.append(closer)
    return tuple(ids), tuple(strings)


ENCODE_CACHE = 4096  # distinct texts kept encoded per protocol (observations are a few hundred bytes)
CACHED_TEXT = 16 << 10  # longer texts are encoded without the cache


class AgentProtocol:
    """How the agent writes calls and sees results. The agent loop uses `stop_token_ids`, `stop_strings`,
    `initial_context`, `decode_turn` and `observation_tokens`; `ProtocolEnv` uses `parse` and
    `system_prompt`; the SFT warm-start uses `action_ids`. Subclasses set `name` and the `_`-methods."""

    name = "base"
    passes_tools = False  # give the tool schemas to the chat template (`tools=`)

    def __init__(self, tokenizer: Any, env: Any, enable_thinking: bool = True) -> None:
        self.tokenizer, self.env = tokenizer, env
        self.template_kwargs: dict[str, Any] = {"enable_thinking": enable_thinking}
        self.tools: list[dict[str, Any]] = list(env.tool_schemas()) if hasattr(env, "tool_schemas") else []
        self.rendering = find_rendering(tokenizer, **self.template_kwargs)
        self.eot_id = int(tokenizer.convert_tokens_to_ids(self.rendering.end_of_turn))
        eos = tokenizer.eos_token_id
        stop_ids, self.stop_strings = stops_for(tokenizer, self.closers())
        self.stop_token_ids: tuple[int, ...] = tuple(
            sorted({self.eot_id, *stop_ids, *([int(eos)] if eos is not None else [])})
        )
        # Episodes of one tree see the same tool results again and again (the same search, a branch's
        # repeat of its trunk's call): their ids are encoded once. The tokenizer is deterministic, so a
        # cached encoding is the encoding; thread-safe, for tool calls in the sampler's pool.
        self._encode_cached = lru_cache(maxsize=ENCODE_CACHE)(self._encode_uncached)
        self._direct_encode = direct_encoder(tokenizer)  # the Rust call, where it equals the wrapper's

    # ---- what subclasses define -------------------------------------------------------------------
    def closers(self) -> tuple[str, ...]:
        """Texts that end a turn besides the end-of-turn token."""
        return ()

    def parse(self, text: str) -> ToolCall | ParseError:
        raise NotImplementedError

    def action_text(self, call: ToolCall) -> str:
        raise NotImplementedError

    def system_prompt(self, env: Any) -> str:
        return str(env.system_prompt())

    # ---- token bookkeeping ------------------------------------------------------------------------
    def prompt_messages(self, system: str, user: str) -> list[dict[str, Any]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def prompt_kwargs(self) -> dict[str, Any]:
        tools = {"tools": self.tools} if self.passes_tools and self.tools else {}
        return {**self.template_kwargs, **tools}

    def initial_context(self, system: str, user: str) -> list[int]:
        """The template's own rendering of [system, user] plus the generation prompt, as ids."""
        text = render(self.tokenizer, self.prompt_messages(system, user), True, **self.prompt_kwargs())
        return self.encode(text)

    def with_tools(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A task's own prompt messages as this protocol shows them (qwen3: the tool schemas added where the
        template ignores `tools=`)."""
        return messages

    def context_of(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The template's own rendering of a task's prompt messages (an outside environment's, which come
        as chat messages: actors/envs/gym) plus the generation prompt, as ids."""
        text = render(self.tokenizer, self.with_tools(list(messages)), True, **self.prompt_kwargs())
        return self.encode(text)

    def messages_tokens(
        self, messages: Sequence[dict[str, Any]], turn: Sequence[int] | None = None
    ) -> list[int]:
        """Ids of an observation given as chat messages (each in its own role: a SkyRL env answers as
        the user) after the sampled `turn`: the template's delta after an assistant turn, as for a tool
        message."""
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        text = render(
            self.tokenizer,
            [*base, {"role": "assistant", "content": _ASSISTANT}, *messages],
            True,
            **self.template_kwargs,
        )
        after, eot = text.split(_ASSISTANT, 1)[1], self.rendering.end_of_turn
        if not after.startswith(eot):
            raise ProtocolError(
                f"the chat template does not end an assistant turn with {eot!r} before a message"
            )
        lead = "" if self.turn_closed(turn) else eot
        return self.encode(lead + after[len(eot) :])

    def encode(self, text: str) -> list[int]:
        if len(text) > CACHED_TEXT:  # a whole prompt (the agent endpoint's): never seen again, not kept
            return list(self._encode_uncached(text))
        return list(self._encode_cached(text))

    def clear_cache(self) -> None:
        self._encode_cached.cache_clear()

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        ids = self._direct_encode(text) if self._direct_encode is not None else None
        if ids is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return tuple(map(int, ids))

    def turn_closed(self, turn: Sequence[int] | None) -> bool:
        """Whether the sampled turn ended with the end-of-turn token (None: assume so, for callers that
        render an observation without a turn)."""
        return turn is None or (len(turn) > 0 and int(turn[-1]) == self.eot_id)

    def observation_tokens(self, observation: str, turn: Sequence[int] | None = None) -> list[int]:
        """Ids of a tool result after the sampled `turn`: the template's tool message and the next
        generation prompt, closing the assistant turn first when the turn stopped before its end."""
        r = self.rendering
        lead = "" if self.turn_closed(turn) else r.end_of_turn
        return self.encode(lead + r.before + observation + r.after)

    def decode_turn(self, token_ids: Sequence[int]) -> str:
        """The sampled turn's text for the parser, without its final stop token (never re-encoded)."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def visible(self, text: str) -> str:
        """The turn's text outside its reasoning."""
        return outside_reasoning(text, self.rendering.opens_think)

    def action_ids(self, call: ToolCall) -> list[int]:
        """What the model should emit for `call` (the SFT target): the call in this protocol's syntax,
        after a `</think>` when the generation prompt opened reasoning, ending with the turn's stop."""
        text = self.action_text(call)
        if self.rendering.opens_think:
            text = f"{THINK_CLOSE}\n\n{text}"
        ids = self.encode(text)
        if self.stop_strings and any(text.endswith(s) for s in self.stop_strings):
            return ids
        return ids if ids and ids[-1] in self.stop_token_ids else [*ids, self.eot_id]


def call_json(call: ToolCall) -> str:
    """A call as Qwen3's JSON object."""
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
