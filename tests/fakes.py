"""Shared fakes: a scripted policy backend (no model) that samples whole turns from a fixed menu.

The menu mixes good searches, answers, malformed text and long rambles, so every loop path runs. Log-probs
are those of the menu choice spread over its tokens (uniform over the menu), so they are genuine log-probs
of what was sampled and finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from system.policy import SampleRequest, SampleResult

MENU = (
    "search: {q}",
    "search: {q}",
    "answer: {a}",
    "answer: nobody",
    "I am not sure what to do",  # no call at all: ends the episode as malformed
    "search: " + "very long query " * 12,  # runs into max_turn_tokens: a truncated turn
)


class TextBackend:
    """What a scripted PolicyBackend shares: no model to score with; a weight load only moves the version."""

    version = 0

    def score(self, context, start):  # pragma: no cover - not a model
        raise NotImplementedError

    def load_weights(self, named_tensors, version: int) -> None:
        self.version = version

    def evict(self, *keys: str) -> None:
        pass  # no caches: nothing to free

    def close(self) -> None:
        pass


class ScriptedBackend(TextBackend):
    """PolicyBackend over a text menu; `q`/`a` are filled from the question the context holds."""

    def __init__(self, tokenizer, seed: int = 0, question_answer=None):
        self.tok = tokenizer
        self.rng = np.random.default_rng(seed)
        self.version = 0
        self.eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.qa = question_answer or (lambda context: ("x relation", "x"))
        self.calls = 0

    def sample(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        self.calls += 1
        out = []
        for req in requests:
            q, a = self.qa(list(req.context))
            text = MENU[int(self.rng.integers(len(MENU)))].format(q=q, a=a)
            ids = [*self.tok.encode(text, add_special_tokens=False), self.eos]
            finish = "stop"
            if len(ids) > req.max_new_tokens:
                ids, finish = ids[: req.max_new_tokens], "length"
            lp = -math.log(len(MENU)) / max(len(ids), 1)
            out.append(SampleResult(ids, [lp] * len(ids), finish))
        return out
