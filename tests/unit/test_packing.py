"""Tree packing (learner/packing.py) and the packed forward (learner/forward.py, learner/tree_attention.py).

The reference is the path-by-path forward: one ordinary causal sequence per leaf through the model's own
attention. Tree-packed log-probs must match it within 1e-5 (fp32) on random trees, with the dense 4D float
mask (eager and sdpa), with the block-sparse tree attention and with FlexAttention (forward).
"""

import numpy as np
import pytest
import torch
from learner_fixtures import awkward_tree as random_tree

from actors.policy.tiny_model import build_tiny_model, build_tokenizer
from learner.forward import full_logits_logprobs, path_logprobs, token_logprobs, tree_plan
from learner.packing import canonical_logp, pack_paths, pack_tree, pack_trees, turn_logp_sums
from system.tree_build import TreeBuilder

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    tok = build_tokenizer(["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=300)
    return build_tiny_model(tok, hidden=64, layers=2, heads=2, kv_heads=1, seed=0)


def three_node_tree():
    """prompt P=[10, 11]; turn 1 = [20, 21] + obs [22]; its children: turn 2 = [30], turn 3 = [40, 41]."""
    b = TreeBuilder("hand", [10, 11])
    a = b.add_turn(0, [20, 21], [-0.1, -0.2], obs_tokens=[22])
    b.add_turn(a, [30], [-0.3])
    b.add_turn(a, [40, 41], [-0.4, -0.5])
    b.set_reward(2, 1.0)
    b.set_reward(3, 0.0)
    return b.build()


def test_hand_checked_positions_mask_and_targets():
    p = pack_tree(three_node_tree())
    # packed order: P P | 20 21 22 | 30 | 40 41 ; turn 3 restarts at position 5, right after obs 22
    assert p.input_ids.tolist() == [[10, 11, 20, 21, 22, 30, 40, 41]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 5, 6]]
    expected = np.array(
        [  # key:  10 11 20 21 22 30 40 41
            [1, 0, 0, 0, 0, 0, 0, 0],  # 10
            [1, 1, 0, 0, 0, 0, 0, 0],  # 11
            [1, 1, 1, 0, 0, 0, 0, 0],  # 20
            [1, 1, 1, 1, 0, 0, 0, 0],  # 21
            [1, 1, 1, 1, 1, 0, 0, 0],  # 22
            [1, 1, 1, 1, 1, 1, 0, 0],  # 30  (branch B)
            [1, 1, 1, 1, 1, 0, 1, 0],  # 40  (branch C: never sees 30)
            [1, 1, 1, 1, 1, 0, 1, 1],  # 41
        ],
        dtype=bool,
    )
    assert np.array_equal(p.dense_allowed()[0].numpy(), expected)
    add = p.additive_mask(torch.float32)
    assert add.shape == (1, 1, 8, 8) and add.dtype == torch.float32
    assert torch.equal(add[0, 0] == 0, torch.from_numpy(expected))
    assert float(add.min()) == torch.finfo(torch.float32).min
    # 40 is predicted from the logits at 22 (parent's last obs token), not at 30 (the previous packed token)
    assert p.target_index.tolist() == [[-1, 0, 1, 2, 3, 4, 4, 6]]
    assert p.turn_ids.tolist() == [[-1, -1, 0, 0, -1, 1, 2, 2]]
    assert p.pair_index.tolist() == [2, 3, 5, 2, 3, 6, 7]  # leaf 2's path, then leaf 3's
    assert p.pair_seq.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert p.q.tolist() == [0.5, 0.5, 0.5]  # no credit yet: neutral teacher


def test_hand_checked_owner_sequences():
    paths = pack_paths(three_node_tree())
    assert paths.input_ids.tolist() == [[10, 11, 20, 21, 22, 30, 0], [10, 11, 20, 21, 22, 40, 41]]
    # turn 1 is owned by the first-created child's sequence (leaf 2); leaf 3's sequence trains turn 3 only
    assert paths.turn_ids.tolist() == [[-1, -1, 0, 0, -1, 1, -1], [-1, -1, -1, -1, -1, 2, 2]]
    full = pack_paths(three_node_tree(), full=True)
    assert full.turn_ids.tolist() == [[-1, -1, 0, 0, -1, 1, -1], [-1, -1, 0, 0, -1, 2, 2]]
    assert full.owned.tolist()[1] == [False] * 5 + [True, True]


@pytest.mark.parametrize("seed", range(6))
def test_owner_sequences_train_each_turn_exactly_once(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, "t")
    owner = pack_paths(tree)
    counts = np.zeros(len(tree.nodes) - 1, int)
    for row in owner.turn_ids.numpy():
        for turn in np.unique(row[row >= 0]):
            counts[turn] += 1
    for i, node in enumerate(tree.nodes[1:]):
        assert counts[i] == (1 if node.loss_mask.any() else 0), f"turn {i} trained {counts[i]} times"
    # the owner copies are exactly the tree-packed loss tokens, none twice
    k_packed, _ = canonical_logp(pack_tree(tree), torch.zeros(pack_tree(tree).turn_ids.shape))
    k_owner, _ = canonical_logp(owner, torch.zeros(owner.turn_ids.shape))
    assert torch.equal(k_packed, k_owner) and len(torch.unique(k_packed)) == len(k_packed)
    # full paths (TreePO): a turn is trained once per leaf below it
    full = pack_paths(tree, full=True)
    below = [sum(i + 1 in tree.path(int(leaf)) for leaf in tree.leaves) for i in range(len(tree.nodes) - 1)]
    for i, node in enumerate(tree.nodes[1:]):
        rows = int(((full.turn_ids == i).sum(1) > 0).sum())
        assert rows == (below[i] if node.loss_mask.any() else 0)


@pytest.mark.parametrize("seed", range(8))
def test_packed_logprobs_match_path_by_path(model, seed):
    rng = np.random.default_rng(100 + seed)
    trees = [random_tree(rng, f"t{i}") for i in range(3)]
    ref_batch = pack_paths(trees)
    with torch.no_grad():
        ref = path_logprobs(model, ref_batch)
        keys, want = canonical_logp(ref_batch, ref)
        want_sums = turn_logp_sums(ref_batch, ref)
        for concat in (False, True):
            packed = pack_trees(trees, concat=concat)
            for attention in ("tree", "mask", "flex"):  # flex: the eager CPU kernel, forward only
                got_keys, got = canonical_logp(packed, token_logprobs(model, packed, attention))
                assert torch.equal(got_keys, keys)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            sums = turn_logp_sums(packed, token_logprobs(model, packed))
            torch.testing.assert_close(sums, want_sums, atol=1e-4, rtol=0)
        # varlen path layout through the tree kernel agrees too
        varlen = pack_paths(trees, concat=True)
        torch.testing.assert_close(
            canonical_logp(varlen, token_logprobs(model, varlen))[1], want, atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_dense_float_mask_matches_with_eager_and_sdpa(model, impl):
    old = model.config._attn_implementation
    model.config._attn_implementation = impl
    try:
        rng = np.random.default_rng(7)
        trees = [random_tree(rng, f"t{i}") for i in range(2)]
        with torch.no_grad():
            _, want = canonical_logp(pack_paths(trees), path_logprobs(model, pack_paths(trees)))
            packed = pack_trees(trees)
            _, got = canonical_logp(packed, token_logprobs(model, packed, attention="mask"))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        model.config._attn_implementation = old


def test_path_reference_matches_the_models_own_forward(model):
    rng = np.random.default_rng(3)
    paths = pack_paths([random_tree(rng, "t")], full=True)
    with torch.no_grad():
        torch.testing.assert_close(
            path_logprobs(model, paths), full_logits_logprobs(model, paths), atol=1e-5, rtol=0
        )


def test_gradients_match_path_by_path(model):
    rng = np.random.default_rng(11)
    trees = [random_tree(rng, f"t{i}") for i in range(2)]
    grads = []
    for batch in (pack_trees(trees, concat=True), pack_paths(trees)):
        model.zero_grad()
        _, lp = canonical_logp(batch, token_logprobs(model, batch))
        lp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_packed_forward_processes_exactly_the_unique_tokens(model, seed):
    rng = np.random.default_rng(200 + seed)
    trees = [random_tree(rng, f"t{i}") for i in range(3)]
    packed = pack_trees(trees, concat=True)
    assert packed.input_ids.numel() == packed.num_tokens == sum(t.num_tokens for t in trees)
    assert pack_tree(trees[0]).input_ids.numel() == trees[0].num_tokens
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    try:
        with torch.no_grad():
            token_logprobs(model, packed)
    finally:
        hook.remove()
    assert seen == [sum(t.num_tokens for t in trees)]
    # every real token is a query of the tree-attention plan exactly once
    plan = tree_plan(packed)
    assert sorted(plan.inverse.tolist()) == sorted(set(plan.inverse.tolist()))


def test_with_behavior_logp_replaces_only_loss_tokens():
    p = pack_tree(three_node_tree())
    new = p.with_behavior_logp(torch.full(p.turn_ids.shape, -1.0))
    on = p.turn_ids >= 0
    assert torch.all(new.behavior_logp[on] == -1.0) and torch.all(torch.isnan(new.behavior_logp[~on]))
    assert torch.equal(new.effective_mask, on)
