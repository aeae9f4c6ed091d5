"""Trees and configs for learner tests: small random trees credited by the backup, made on-policy."""

import dataclasses

import numpy as np
import torch

from actors.policy.tiny_model import build_tokenizer
from benchmarks.workloads import random_rollout_tree
from configs.schema import parse_config
from learner.forward import token_logprobs
from learner.packing import pack_tree
from system.credit import credit_rollout_tree
from system.tree import RolloutTree
from system.tree_build import TreeBuilder

SMALL = {"prompt": (4, 8), "turn": (3, 6), "obs": (2, 4), "turns": (1, 3)}


def small_tokenizer():
    """A 300-token BPE tokenizer (the `tok` fixture of tests/conftest.py)."""
    return build_tokenizer(["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=300)


def config(**sections):
    data = {"algo": {"rho": 0.4}, "learner": {"minibatches": 2, "lr": 3e-3}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return parse_config(data)


def make_trees(tok, n=3, seed=0, **kw):
    rng = np.random.default_rng(seed)
    algo = config().algo
    return [
        credit_rollout_tree(random_rollout_tree(rng, f"t{i}", len(tok), **{**SMALL, **kw}), algo)
        for i in range(n)
    ]


def on_policy(model, trees: list[RolloutTree]) -> list[RolloutTree]:
    """The same trees with μ := the model's own log-probs (s ≡ 0 before any update)."""
    out = []
    for tree in trees:
        p = pack_tree(tree)
        with torch.no_grad():
            lp = token_logprobs(model, p)[0].numpy()
        new = {n.node_id: n.behavior_logprobs.copy() for n in tree.nodes}
        for c in np.flatnonzero(p.turn_ids[0].numpy() >= 0):
            new[int(p.turn_ids[0, c]) + 1][int(p.token_offset[0, c])] = lp[c]
        nodes = [dataclasses.replace(n, behavior_logprobs=new[n.node_id]) for n in tree.nodes]
        out.append(RolloutTree.build(tree.tree_id, nodes, credit=tree.credit))
    return out


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def awkward_tree(rng: np.random.Generator, tree_id: str, vocab: int = 200, max_len: int = 9):
    """Small init–expand-like tree with awkward cases: zero-length turns and observations, partial loss
    masks, NaN behavior log-probs on loss tokens, several children at one anchor, an empty prompt (the first
    token then has no context and is left out of the loss in both layouts)."""
    b = TreeBuilder(tree_id, rng.integers(3, vocab, int(rng.integers(0, 6))))  # empty prompts too
    made: list[int] = []

    def turn(parent: int) -> int:
        size = int(rng.integers(0, max_len))
        lp = np.log(rng.uniform(0.05, 1, size)).astype(np.float32)
        lp[rng.random(size) < 0.05] = np.nan
        mask = rng.random(size) < 0.85
        obs = rng.integers(3, vocab, int(rng.integers(0, 5)))
        made.append(b.add_turn(parent, rng.integers(3, vocab, size), lp, obs, loss_mask=mask))
        return made[-1]

    frontier = [0]
    for _ in range(int(rng.integers(1, 4))):  # trajectories
        node, chain = 0, []
        for _ in range(int(rng.integers(1, 4))):
            node = turn(node)
            chain.append(node)
        frontier += chain
    for _ in range(int(rng.integers(0, 4))):  # branches under random existing turns
        node = turn(int(rng.choice(frontier[1:])))
        if rng.random() < 0.5:
            turn(node)
    parents = {b.node(i).parent for i in made}
    for i in made:
        if i not in parents:
            b.set_reward(i, float(rng.random() < 0.5))
    return b.build()
