"""Restarts (system/tree.py): a turn node without tokens whose observation opens a new context, as an external
agent's compaction or summary call does (docs/external-agents.md). The turns under it must be scored after
that context alone, in every layout the learner packs (tree pieces, path rows, budget micro-batches), and the
tree must survive the store's codec and validation."""

import json

import numpy as np
import pytest
import torch

from actors.policy.tiny_model import build_tiny_model, build_tokenizer
from learner.forward import path_logprobs, token_logprobs
from learner.packing import canonical_logp, pack_paths, pack_pieces, pack_trees
from storage.tree_codec import decode_ipc, encode_ipc
from system.credit import credit_rollout_tree
from system.microbatch import first_fit_decreasing, loss_token_counts, split_tree
from system.tree import RESTARTS, RolloutTree, TreeValidationError
from system.tree_build import TreeBuilder
from tests.learner_fixtures import config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    tok = build_tokenizer(["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=300)
    return build_tiny_model(tok, hidden=64, layers=2, heads=2, kv_heads=1, seed=0)


def compacted_tree():
    """P=[10, 11]; a1=[20, 21] obs [22]; restart R (context [50, 51, 52]) under a1; b1=[60] obs [61] under R;
    two leaves under b1: b2=[70, 71] and b2'=[80]."""
    b = TreeBuilder("c", [10, 11])
    a1 = b.add_turn(0, [20, 21], [-0.1, -0.2], obs_tokens=[22])
    r = b.add_restart(a1, [50, 51, 52])
    b1 = b.add_turn(r, [60], [-0.3], obs_tokens=[61])
    for toks in ([70, 71], [80]):
        b.set_reward(b.add_turn(b1, toks, [-0.5] * len(toks)), float(len(toks) == 1))
    assert b.context_tokens(b1) == [50, 51, 52, 60, 61]  # the branch prefix stops at the restart
    return b.build()


def test_a_restart_opens_its_own_context_in_every_layout():
    tree = compacted_tree()
    assert tree.restarts == {2} and json.loads(tree.meta[RESTARTS]) == [2]
    assert tree.context_runs(4) == [[0, 1], [2, 3, 4]]
    p = pack_trees([tree], concat=True)  # two pieces back to back: [P a1 o1] [R's context b1 o b2 b2']
    assert p.input_ids.tolist() == [[10, 11, 20, 21, 22, 50, 51, 52, 60, 61, 70, 71, 80]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 5]]  # restarting at R
    assert p.target_index.tolist() == [[-1, 0, 1, 2, 3, -1, 5, 6, 7, 8, 9, 10, 9]]
    allowed = p.dense_allowed()[0].numpy()
    assert not allowed[5:, :5].any() and allowed[8, 5:9].all()  # R's turns never see P, a1 or o1
    paths = pack_paths(tree, full=True)  # per leaf: a row per context its path crosses
    assert paths.input_ids.tolist() == [
        [10, 11, 20, 21, 22, 0, 0],
        [50, 51, 52, 60, 61, 70, 71],
        [10, 11, 20, 21, 22, 0, 0],
        [50, 51, 52, 60, 61, 80, 0],
    ]
    assert paths.pair_seq.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]  # leaf 4: a1, b1, b2; leaf 5: a1, b1, b2'
    # loss tokens of b1 (node 3): its context is the restart's 3 tokens, so every token has logits
    assert loss_token_counts(tree) == [0, 2, 0, 1, 2, 1]


def restart_tree(rng: np.random.Generator, tree_id: str, vocab: int = 200) -> RolloutTree:
    """A random init–expand-like tree whose trajectories compact: before a turn, now and then a restart with a
    fresh context; branches under random turns (and under restarts' turns)."""
    b = TreeBuilder(tree_id, rng.integers(3, vocab, int(rng.integers(1, 6))))
    made: list[int] = []
    parents: set[int] = set()

    def turn(parent: int) -> int:
        if rng.random() < 0.35:
            parents.add(parent)
            parent = b.add_restart(parent, rng.integers(3, vocab, int(rng.integers(1, 7))))
        parents.add(parent)
        size = int(rng.integers(1, 7))
        lp = np.log(rng.uniform(0.05, 1, size)).astype(np.float32)
        obs = rng.integers(3, vocab, int(rng.integers(0, 4)))
        made.append(b.add_turn(parent, rng.integers(3, vocab, size), lp, obs))
        return made[-1]

    for _ in range(int(rng.integers(1, 4))):
        node = 0
        for _ in range(int(rng.integers(1, 5))):
            node = turn(node)
    for _ in range(int(rng.integers(1, 4))):
        turn(int(rng.choice(made)))
    for i in made:
        if i not in parents:
            b.set_reward(i, float(rng.random() < 0.5))
    return b.build()


def direct_logprobs(model, tree: RolloutTree) -> dict[int, torch.Tensor]:
    """Each turn scored alone: its exact context (from the nearest restart) then its tokens, one plain row."""
    out = {}
    for i in range(1, len(tree.nodes)):
        n = tree.nodes[i]
        if not len(n.tokens):
            continue
        ctx = []
        for j in tree.context_runs(i)[-1][:-1]:
            ctx += [*tree.nodes[j].tokens.tolist(), *tree.nodes[j].obs_tokens.tolist()]
        ids = torch.tensor([[*ctx, *n.tokens.tolist()]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
        out[i] = logp[len(ctx) - 1 : -1].gather(1, ids[0, len(ctx) :, None])[:, 0]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_packed_log_probs_are_each_turns_own_context(model, seed):
    rng = np.random.default_rng(7 + seed)
    trees = [restart_tree(rng, f"r{k}") for k in range(3)]
    assert any(t.restarts for t in trees)
    offsets = np.cumsum([0, *(len(t.nodes) - 1 for t in trees)])
    want = torch.cat(
        [v for k, t in enumerate(trees) for i, v in sorted(direct_logprobs(model, t).items())]
    ).double()
    keys_direct = [
        (offsets[k] + i - 1) * (1 << 32) + o
        for k, t in enumerate(trees)
        for i in sorted(direct_logprobs(model, t))
        for o in range(len(t.nodes[i].tokens))
    ]
    with torch.no_grad():
        ref = pack_paths(trees)
        keys, got = canonical_logp(ref, path_logprobs(model, ref))
        assert keys.tolist() == keys_direct
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
        for concat in (False, True):
            packed = pack_trees(trees, concat=concat)
            for attention in ("tree", "mask", "flex"):
                k2, lp = canonical_logp(packed, token_logprobs(model, packed, attention))
                assert torch.equal(k2, keys)
                torch.testing.assert_close(lp.double(), want, atol=1e-5, rtol=0)
        pieces = [p for k, t in enumerate(trees) for p in split_tree(k, t, 12)]  # budget micro-batches
        owned = sorted((p.tree, i) for p in pieces for i in p.owned)
        assert owned == sorted((k, i) for k, t in enumerate(trees) for i in range(len(t.nodes)))
        got = {}
        for micro in first_fit_decreasing(pieces, 12):
            m = pack_pieces(trees, micro)  # its turns numbered over the trees it holds: back to global keys
            sel = m.owned & (m.turn_ids >= 0)
            turn = m.turn_ids[sel]
            glob = torch.from_numpy(offsets)[m.turn_tree[turn]] + m.turn_node[turn] - 1
            for key, v in zip(
                (glob * (1 << 32) + m.token_offset[sel]).tolist(), token_logprobs(model, m)[sel], strict=True
            ):
                got[key] = float(v)
        assert sorted(got) == keys.tolist()
        torch.testing.assert_close(
            torch.tensor([got[k] for k in sorted(got)]).double(), want, atol=1e-5, rtol=0
        )


def test_restarts_survive_the_codec_and_the_credit():
    tree = credit_rollout_tree(compacted_tree(), config().algo)
    [back] = decode_ipc(encode_ipc([tree]))
    assert back.equals(tree) and back.restarts == {2}
    assert np.isfinite(tree.credit.V[1:]).all()  # the restart is a turn of the backup like any other


@pytest.mark.parametrize(
    ("restarts", "why"),
    [("[1]", "a restart has no turn tokens"), ("[9]", "restart 9 is not a turn node"), ("{", "not a JSON")],
)
def test_a_bad_restart_is_named(restarts, why):
    tree = compacted_tree()
    with pytest.raises(TreeValidationError, match=why):
        RolloutTree.build(tree.tree_id, tree.nodes, meta={RESTARTS: restarts})
