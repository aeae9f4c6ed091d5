"""What the benchmarks share: random initialize–expand trees, a tokenizer over random words, and a bounded
wait (used by the learner and weight benchmarks, and by tests that need the same workloads)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from actors.policy.tiny_model import build_tokenizer
from system.tree import RolloutTree
from system.tree_build import TreeBuilder, choose_anchors


def random_rollout_tree(
    rng: np.random.Generator,
    tree_id: str,
    vocab: int,
    m: int = 4,
    n: int = 2,
    prompt: tuple[int, int] = (50, 70),
    turn: tuple[int, int] = (15, 40),
    obs: tuple[int, int] = (35, 45),
    turns: tuple[int, int] = (2, 5),
    reward_p: float = 0.5,
) -> RolloutTree:
    """An initialize–expand tree with random token ids in [3, vocab) and random log-probs (§2.2–2.3).

    Lengths are inclusive ranges; branches from anchor k take T' − k turns, T' ~ U{k+1..turns[1]}.
    """

    def draw(lo_hi: tuple[int, int], size: int | None = None) -> Any:
        return rng.integers(lo_hi[0], lo_hi[1] + 1, size=size)

    b = TreeBuilder(tree_id, rng.integers(3, vocab, draw(prompt)))

    def chain(parent: int, length: int) -> list[int]:
        ids = []
        for _ in range(length):
            size = int(draw(turn))
            lp = np.log(rng.uniform(0.05, 1.0, size)).astype(np.float32)
            parent = b.add_turn(parent, rng.integers(3, vocab, size), lp, rng.integers(3, vocab, draw(obs)))
            ids.append(parent)
        return ids

    leaves = []
    for _ in range(m):
        t = int(draw(turns))
        main = chain(0, t)
        leaves.append(main[-1])
        for k in choose_anchors(t, n, rng):
            leaves.append(chain(main[k - 1], int(rng.integers(k + 1, max(turns[1], k + 1) + 1)) - k)[-1])
    for leaf in leaves:
        b.set_reward(leaf, float(rng.random() < reward_p))
    return b.build()


def bench_tokenizer():
    """A 1024-token BPE tokenizer over random words (the learner benchmarks' vocabulary)."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, int(rng.integers(2, 9)))) for _ in range(4000)]
    return build_tokenizer([" ".join(words[i : i + 20]) for i in range(0, len(words), 20)], vocab_size=1024)


def wait_until(pred: Any, what: str, timeout_s: float = 300) -> None:
    """Until `pred()`; a publisher that never gets there fails the run instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s} s")
        time.sleep(0.005)


def qwen2_config_for_bytes(
    target_bytes: int, value_bytes: int, vocab: int, shape: tuple[int, int, int, int]
) -> dict[str, Any]:
    """Qwen2 config kwargs whose state dict (`value_bytes` per value, untied embeddings) is about
    `target_bytes`; shape = (hidden, ffn, heads, kv_heads), the layer count makes up the size."""
    hidden, ffn, heads, kv_heads = shape
    per_layer = value_bytes * (
        2 * hidden * hidden + 2 * hidden * hidden * kv_heads // heads + 3 * hidden * ffn
    )
    layers = max(1, round((target_bytes - 2 * value_bytes * vocab * hidden) / per_layer))
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=False,
    )
