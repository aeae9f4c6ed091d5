"""CPU proxies of the CUDA flex path (learner/flex_attention.py; CI has no GPU): the block tables built from
the tree's intervals against the dense mask, for padded batches too; micro-batch lengths of random batches in
at most `BUCKETS` buckets with their padding share; and the compile count of the compiled kernel (the CPU
compiles FlexAttention's forward: one graph per bucket length, none for a new tree of a known length)."""

import numpy as np
import pytest
import torch

from actors.policy.tiny_model import build_tiny_model, build_tokenizer
from benchmarks.workloads import random_rollout_tree
from learner.flex_attention import (
    BUCKETS,
    block_tables,
    bucket_length,
    bucket_lengths,
    compiled_graphs,
    tree_block_mask,
)
from learner.forward import token_logprobs
from learner.minibatch import pack_microbatch, plan_microbatches
from learner.packing import canonical_logp, pack_trees


@pytest.fixture(scope="module")
def model():
    tok = build_tokenizer(["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=300)
    return build_tiny_model(tok, hidden=64, layers=2, heads=2, kv_heads=1, seed=0)


AGENTIC = {"prompt": (30, 60), "turn": (10, 50), "obs": (15, 45), "turns": (3, 6)}  # the GPU bench's / 10


def test_bucket_lengths_by_hand():
    # budget 1000: 1000 − 500, 1000 − 250, 1000 − 125, 1000, each rounded up to 128: 512, 768, 896, 1024
    assert bucket_lengths(1000) == [512, 768, 896, 1024]
    assert bucket_lengths(16384) == [8192, 12288, 14336, 16384]  # the GPU bench's budget
    assert [bucket_length(n, 1000) for n in (1, 512, 513, 900, 1024)] == [512, 512, 768, 1024, 1024]
    assert bucket_length(1100, 1000) == 1536  # over budget: the next multiple of the smallest (3 · 512)
    assert bucket_length(300, 0) == 512 and bucket_length(5, 0) == 128  # no budget: powers of two


def dense_from_tables(reach: torch.Tensor) -> torch.Tensor:
    """[T, T] what the kernel computes: full blocks all visible, partial blocks by the mask function, the
    rest nothing."""
    t = reach.shape[1]
    partial, full = block_tables(reach)
    mask = tree_block_mask(reach, "cpu")
    q, kv = torch.arange(t)[:, None], torch.arange(t)[None, :]
    by_function = mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)
    block = lambda table: table[0].repeat_interleave(128, 0).repeat_interleave(128, 1)[:t, :t]  # noqa: E731
    return block(full) | (block(partial) & by_function)


@pytest.mark.parametrize("seed", range(4))
def test_block_tables_give_the_dense_mask_padded_or_not(seed):
    rng = np.random.default_rng(seed)
    trees = [random_rollout_tree(rng, f"t{i}", 500, **AGENTIC) for i in range(3)]
    packed = pack_trees(trees, concat=True)
    for length in (packed.input_ids.shape[1], bucket_length(packed.input_ids.shape[1], 1024)):
        padded = packed.padded_to(length)
        assert torch.equal(dense_from_tables(padded.reach), padded.dense_allowed()[0])
    partial, full = block_tables(padded.reach)
    assert full.any() and (~partial & ~full).any()  # the tree has full and skipped blocks, not only partial


def test_padded_flex_forward_equals_the_chunked_plan(model):
    rng = np.random.default_rng(5)
    trees = [random_rollout_tree(rng, f"t{i}", 200) for i in range(2)]
    packed = pack_trees(trees, concat=True)
    padded = packed.padded_to(bucket_length(packed.input_ids.shape[1], 512))
    assert padded.input_ids.shape[1] > packed.input_ids.shape[1] and padded.num_tokens == packed.num_tokens
    with torch.no_grad():
        keys, want = canonical_logp(packed, token_logprobs(model, packed, "tree"))
        got_keys, got = canonical_logp(padded, token_logprobs(model, padded, "flex"))
    assert torch.equal(got_keys, keys)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # pair_index renumbered for the wider row: the same token ids behind every (token, path) pair
    assert torch.equal(
        padded.input_ids.flatten()[padded.pair_index], packed.input_ids.flatten()[packed.pair_index]
    )


@pytest.mark.parametrize("packed_layout", [True, False])
def test_fifty_random_batches_fall_in_four_buckets(packed_layout):
    """50 batches of 4 agentic trees, 2 mini-batches each, 2048-token budget: every micro-batch length in
    one of the 4 buckets; the padding share per bucket is printed (the bench reports it too)."""
    rng = np.random.default_rng(0)
    budget, pads = 2048, {}
    for b in range(50):
        trees = [random_rollout_tree(rng, f"b{b}t{i}", 500, **AGENTIC) for i in range(4)]
        for half in (trees[:2], trees[2:]):
            for micro in plan_microbatches(half, budget, packed_layout):
                n = pack_microbatch(half, micro, packed_layout, full=False, concat=True).input_ids.shape[1]
                pads.setdefault(bucket_length(n, budget), []).append(n)
    assert set(pads) <= set(bucket_lengths(budget)) and len(pads) <= BUCKETS
    share = {k: round(1 - sum(v) / (k * len(v)), 3) for k, v in sorted(pads.items())}
    overall = 1 - sum(sum(v) for v in pads.values()) / sum(k * len(v) for k, v in pads.items())
    print(f"\nbuckets (length: padding share) {share}, overall {overall:.3f}")
    assert overall < 0.25  # a full bucket pads < 1 step of 4; most micro-batches are full ones


@pytest.mark.slow
def test_compiled_kernel_compiles_once_per_bucket():
    from torch.nn.attention.flex_attention import flex_attention

    kernel = torch.compile(flex_attention, dynamic=False)
    rng = np.random.default_rng(1)
    before = compiled_graphs()
    seen = []
    for i in range(4):  # ~1.5k–3k tokens each, bucketed to 1024-token steps under a 4096 budget
        tree = random_rollout_tree(rng, f"c{i}", 100)
        packed = pack_trees([tree], concat=True)
        padded = packed.padded_to(bucket_length(packed.input_ids.shape[1], 4096))
        seen.append(padded.input_ids.shape[1])
        q = torch.randn(1, 2, seen[-1], 8)
        kernel(q, q, q, block_mask=tree_block_mask(padded.reach, "cpu"))
    assert compiled_graphs() - before == len(set(seen))
    assert len(set(seen)) < len(seen)  # a length came back: the new tree did not compile again
