"""Trees sampled by the real HF backend (tiny random Qwen2): tree invariants and token-in/token-out —
re-scoring each owner sequence's stored ids with the same weights reproduces the stored behavior log-probs."""

import numpy as np
import pytest

from actors.agent_loop import LoopLimits
from actors.chat import ChatFormat
from actors.envs.synthetic_kb import KBConfig, SyntheticKBEnv, tokenizer_texts
from actors.policy.hf_backend import HFBackend
from actors.policy.tiny_model import build_tiny_model, build_tokenizer
from actors.tree_sampler import TreeSampler, TreeShape
from system.policy import SamplingConfig


@pytest.fixture(scope="module")
def setup():
    env = SyntheticKBEnv(config=KBConfig(n_persons=40, n_companies=10, n_cities=12, n_countries=5))
    tok = build_tokenizer(tokenizer_texts(env, n_questions=200, n_oracle=20))
    model = build_tiny_model(tok, seed=0)
    backend = HFBackend(model, tok, sampling=SamplingConfig(seed=0))
    return env, tok, backend


def sequence_of(tree, leaf):
    """Prompt + (turn, obs)* along root→leaf, and each path turn's (start, end) span in that sequence."""
    ids, spans = list(tree.prompt_tokens), {}
    for i in tree.path(leaf):
        n = tree.nodes[i]
        spans[i] = (len(ids), len(ids) + len(n.tokens))
        ids += [*n.tokens.tolist(), *n.obs_tokens.tolist()]
    return ids, spans


def test_hf_trees_invariants_and_logprob_rescoring(setup):
    env, tok, backend = setup
    chat = ChatFormat.from_tokenizer(tok)
    limits = LoopLimits(max_turns=3, max_turn_tokens=12, token_budget=300)
    sampler = TreeSampler(backend, env, chat, TreeShape(M=2, N=2), limits)
    trees = sampler.sample_trees(env.tasks("train", n=2), np.random.default_rng(0))
    worst = 0.0
    for tree in trees:
        assert len(tree.children[0]) == 2
        assert tree.num_leaves == 2 + sum(len(c) - 1 for c in tree.children[1:] if c)
        for leaf in tree.leaves:
            ids, spans = sequence_of(tree, leaf)
            for i, (a, b) in spans.items():
                if tree.owner_leaf[i] != leaf:
                    continue  # each turn is checked once, on its owner sequence
                rescored = np.array(backend.score(ids[:b], a))
                stored = tree.nodes[i].behavior_logprobs.astype(np.float64)
                worst = max(worst, float(np.abs(rescored - stored).max()))
    assert worst <= 1e-5, worst
