"""Token-level chat bookkeeping for the agent loop: the prompt's ids, and the ids of a tool observation.

Token-in/token-out: the model's turns are kept exactly as sampled; only environment text (the prompt and
tool observations) is ever tokenized. The observation wrapper comes from the tokenizer's own chat template,
so any HF chat model works, not only the tiny ChatML one:

    render [sys, user, assistant "A", tool "<<OBS>>"] + generation prompt, take what follows the assistant
    turn's end-of-turn token, split at the sentinel → (before, after); obs ids = encode(before + obs + after).

For ChatML that is "\\n<|im_start|>tool\\n" + obs + "<|im_end|>\\n<|im_start|>assistant\\n" (the newline after
<|im_end|> belongs to the observation, since the model stops at <|im_end|>).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_SENTINEL = "<<TREEOPSD_OBS>>"
_ASSISTANT = "<<TREEOPSD_ASSISTANT>>"


@dataclass
class ChatFormat:
    """Built once per tokenizer; `observation_tokens` is on the sampler's hot path, so it is cheap."""

    tokenizer: Any
    obs_before: str
    obs_after: str
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...] = ()  # ChatML turns stop at the eos token only

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, tool_role: str = "tool") -> ChatFormat:
        eos = tokenizer.eos_token
        if eos is None or tokenizer.chat_template is None:
            raise ValueError("the tokenizer needs an eos token and a chat template for multi-turn rollouts")
        base = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": _ASSISTANT},
        ]
        text = tokenizer.apply_chat_template(
            [*base, {"role": tool_role, "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
        after_turn = text.split(_ASSISTANT, 1)[1]
        if not after_turn.startswith(eos):
            raise ValueError(f"chat template does not end an assistant turn with the eos token {eos!r}")
        before, after = after_turn[len(eos) :].split(_SENTINEL, 1)
        stops = tuple(sorted({tokenizer.convert_tokens_to_ids(eos)}))
        return cls(tokenizer, before, after, stops)

    def initial_context(self, system: str, user: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def context_of(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The template's rendering of a task's own prompt messages plus the generation prompt, as ids."""
        ids = self.tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def observation_tokens(self, observation: str, turn: Sequence[int] | None = None) -> list[int]:
        """Ids after a turn that ended with the eos token (`turn`, the sampled ids, is not needed here)."""
        return list(
            self.tokenizer.encode(self.obs_before + observation + self.obs_after, add_special_tokens=False)
        )

    def decode_turn(self, token_ids: Sequence[int]) -> str:
        """Text of a sampled turn for the environment's parser (never re-encoded)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
