"""Free-text thinking spans for the synthetic task (`env.think_tokens`): turns of a chosen length, so that the
off-policy experiment sees the turn lengths real thinking agents write (docs/algorithm.md §11.1).

A span is a countdown of `chunks` chunks, each a number and six words drawn uniformly from `THINK_WORDS`,
written after the turn's call::

    search: Dakom leader
    <think> 3 employer the mentor of or founder 2 ... 0 leader is the capital of country </think>

about eight tokens a chunk with the tiny model's tokenizer (each word is one token of it, a number two or
three). The words carry nothing the task needs: they are text the policy samples freely (high entropy, so its
drift between versions shows on every token). The budget closes the user prompt and every observation
(`Think N.`), a few tokens before the span that spends it, so even the tiny model starts its countdown right
and ends the span on time, greedy decoding included; one warm start (trained on budgets 1..MAX_CHUNKS) serves
every length. The span follows the call, not the reverse, because the tiny model's two layers copy the next
entity from the observation just before the call: a span in between costs it the task.
"""

from __future__ import annotations

import random

CHUNK_TOKENS = 8  # about: one number (2–3 tokens) and six words (one token each)
MAX_CHUNKS = 64  # env.think_tokens ≤ 512
WORDS_PER_CHUNK = 6
THINK_WORDS = (
    "the", "of", "is", "or", "search", "answer", "birthplace", "employer", "mentor", "headquarters",
    "founder", "country", "capital", "leader",
)  # fmt: skip


def chunks_for(think_tokens: int) -> int:
    """Chunks of a span of `think_tokens` tokens (a multiple of CHUNK_TOKENS, checked by the config)."""
    return think_tokens // CHUNK_TOKENS


def with_budget(text: str, chunks: int) -> str:
    """A user prompt or an observation that asks for a span of `chunks` chunks next (unchanged for 0)."""
    return f"{text}\nThink {chunks}." if chunks > 0 else text


def think_text(chunks: int, rng: random.Random) -> str:
    """One span of `chunks` chunks, counting down to 0 (empty for 0 chunks)."""
    if chunks <= 0:
        return ""
    parts = []
    for k in range(chunks - 1, -1, -1):
        parts.append(" ".join([str(k), *rng.choices(THINK_WORDS, k=WORDS_PER_CHUNK)]))
    return "\n<think> " + " ".join(parts) + " </think>"
