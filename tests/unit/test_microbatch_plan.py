"""Micro-batch planning (system/microbatch.py): every node trained by exactly one piece, each piece carrying
exactly its ancestors as context, within budget; first-fit-decreasing bins; loss-token counts without a
forward; split pieces give each owned token the log-prob of the whole tree."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from learner_fixtures import awkward_tree, small_tokenizer

from actors.policy.tiny_model import build_tiny_model
from learner.forward import token_logprobs
from learner.packing import canonical_logp, pack_pieces, pack_trees
from system.microbatch import (
    first_fit_decreasing,
    loss_token_counts,
    node_tokens,
    path_token_counts,
    recomputed_tokens,
    split_tree,
)
from system.tree_build import TreeBuilder

torch.set_num_threads(1)


def chain_tree():
    """Prompt 4 tokens; turn 1 = 3 + obs 2; under it turn 2 = 4 + obs 1, turn 3 = 2; under 3, turn 4 (5)."""
    b = TreeBuilder("hand", [5, 6, 7, 8])
    a = b.add_turn(0, [10, 11, 12], [-0.1] * 3, obs_tokens=[20, 21])
    b.add_turn(a, [30, 31, 32, 33], [-0.2] * 4, obs_tokens=[22])
    c = b.add_turn(a, [40, 41], [-0.3] * 2)
    b.add_turn(c, [50, 51, 52, 53, 54], [-0.4] * 5)
    for leaf in (2, 4):
        b.set_reward(leaf, 1.0)
    return b.build()


def test_hand_checked_split():
    # node tokens: root 4, n1 5, n2 5, n3 2, n4 5 (total 21); budget 12. The root (4) + n1's subtree (17)
    # does not fit, nor n1 (context 4 + 5) + n2's subtree (5) = 14, nor + n3's subtree (7) = 16; n2 alone
    # with context 9 is 14 > 12: a piece of its own; n3 (context 9 + 2 = 11) + n4 (5) = 16 > 12: n4 is split
    # off with context root, n1, n3 (11). Nodes beside which nothing fitted are owned by their first split
    # child's piece, which forwards them anyway: n3 → n4's piece, n1 → n2's piece, the root → that one too.
    # Pieces: {0, 1, 2} (14 tokens, no context; over budget only because n2 is, with its chain) and
    # {3, 4} with context {0, 1} (9 + 2 + 5 = 16): 9 tokens forwarded twice.
    tree = chain_tree()
    assert node_tokens(tree) == [4, 5, 5, 2, 5]
    pieces = split_tree(0, tree, 12)
    assert sorted(sorted(p.owned) for p in pieces) == [[0, 1, 2], [3, 4]]
    a, b = sorted(pieces, key=lambda p: min(p.owned))
    assert (a.nodes, a.context, a.tokens) == ((0, 1, 2), 0, 14)
    assert (b.nodes, b.context, b.tokens) == ((0, 1, 3, 4), 9, 16)
    assert recomputed_tokens([pieces]) == 9
    assert split_tree(0, tree, 21)[0].owned == frozenset(range(5))  # fits: one piece, no context
    # budget 17: n1's subtree (17) + the root (4) = 21 > 17; under n1 (context 9) n2 fits (14), n3's
    # subtree does not (21): {3, 4} split off with context {0, 1}: 9 + 7 = 16 ≤ 17.
    assert sorted(sorted(p.owned) for p in split_tree(0, tree, 17)) == [[0, 1, 2], [3, 4]]


def test_loss_token_counts_hand_checked():
    tree = chain_tree()
    assert loss_token_counts(tree) == [0, 3, 4, 2, 5]
    assert path_token_counts(tree, loss_token_counts(tree)) == [3 + 4, 3 + 2 + 5]  # leaves 2 and 4


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 80))
def test_pieces_partition_the_tree(seed, budget):
    tree = awkward_tree(np.random.default_rng(seed), "t")
    sizes = node_tokens(tree)
    pieces = split_tree(3, tree, budget)
    owners = [i for p in pieces for i in p.owned]
    assert sorted(owners) == list(range(len(tree.nodes)))  # each node trained by exactly one piece
    for p in pieces:
        assert p.tree == 3
        context = [i for i in p.nodes if i not in p.owned]
        top = min(p.owned, key=lambda i: len(tree.path(i)) if i else 0)
        assert context == ([] if top == 0 else [0, *tree.path(top)[:-1]])  # exactly the ancestors
        assert p.context == sum(sizes[i] for i in context)
        assert p.tokens == sum(sizes[i] for i in p.nodes)
        if p.tokens > budget:  # only a node too long for the budget, with the chain of ancestors merged in
            assert all(sum(c in p.owned for c in tree.children[i]) <= 1 for i in p.owned)
        assert list(p.nodes) == [i for i in map(int, tree.topological_order) if i in p.nodes]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30), budget=st.integers(1, 100))
def test_first_fit_decreasing_respects_the_budget(sizes, budget):
    from system.microbatch import Piece

    pieces = [Piece(k, (0,), frozenset({0}), s, 0) for k, s in enumerate(sizes)]
    bins = first_fit_decreasing(pieces, budget)
    assert sorted(p.tree for b in bins for p in b) == list(range(len(sizes)))
    for b in bins:
        assert sum(p.tokens for p in b) <= budget or len(b) == 1
    # first fit never leaves two bins that would fit together (else it would have merged them)
    loads = sorted(sum(p.tokens for p in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > budget or max(sizes) > budget


@pytest.mark.parametrize("seed", range(4))
def test_split_pieces_give_the_whole_trees_logprobs(seed):
    model = build_tiny_model(small_tokenizer(), seed=0)
    rng = np.random.default_rng(300 + seed)
    trees = [awkward_tree(rng, f"t{i}") for i in range(3)]
    with torch.no_grad():
        whole = pack_trees(trees, concat=True)
        keys, want = canonical_logp(whole, token_logprobs(model, whole))
        pieces = [p for k, t in enumerate(trees) for p in split_tree(k, t, 12)]
        assert len(pieces) > len(trees)  # some tree is split, or the test proves less
        first_turn = torch.tensor(np.cumsum([0] + [len(t.nodes) - 1 for t in trees]))
        got_k, got_v = [], []
        for micro in first_fit_decreasing(pieces, 12):
            packed = pack_pieces(trees, micro)
            k, v = canonical_logp(packed, token_logprobs(model, packed))
            turn = k >> 32  # this micro-batch's turn numbering → the whole batch's, via (tree, node)
            whole_turn = first_turn[packed.turn_tree[turn]] + packed.turn_node[turn] - 1
            got_k.append(whole_turn * (1 << 32) + (k & ((1 << 32) - 1)))
            got_v.append(v)
    k, v = torch.cat(got_k), torch.cat(got_v)
    order = torch.argsort(k)
    assert torch.equal(k[order], keys)  # every owned loss token exactly once over the micro-batches
    torch.testing.assert_close(v[order], want, atol=1e-5, rtol=0)
