"""Which placement-group bundle each learner rank takes (runtime/placement.py): a node's ranks contiguous,
nodes in order (most GPUs first, then node id), each rank's first GPU index on its node right."""

from __future__ import annotations

import pytest

from runtime.placement import node_order, rank_slots


def test_ranks_take_interleaved_bundles_node_by_node():
    # Ray numbered the bundles A, B, A, B: the old identity (rank = bundle) put ranks 0 and 2 on A
    slots = rank_slots(["B", "A", "B", "A"], {"A": 2, "B": 2}, gpus_per_rank=1)
    assert [s.rank for s in slots] == [0, 1, 2, 3]
    assert [s.bundle for s in slots] == [1, 3, 0, 2]
    assert [s.node_id for s in slots] == ["A", "A", "B", "B"]
    assert [s.local_rank for s in slots] == [0, 1, 0, 1]
    assert [s.gpu_offset for s in slots] == [0, 1, 0, 1]


def test_the_node_with_most_gpus_starts_and_multi_gpu_ranks_get_their_offsets():
    # 2 GPUs a rank: 3 ranks on "big" (6 GPUs), 1 on "small" (2 GPUs), bundles in Ray's scrambled order
    slots = rank_slots(["small", "big", "big", "big"], {"big": 6, "small": 2}, gpus_per_rank=2)
    assert [(s.node_id, s.bundle, s.gpu_offset) for s in slots] == [
        ("big", 1, 0),
        ("big", 2, 2),
        ("big", 3, 4),
        ("small", 0, 0),
    ]


def test_node_order_breaks_gpu_ties_by_node_id_and_cpu_ranks_keep_bundle_order():
    assert node_order(["c", "a", "b", "a"], {"a": 1, "b": 4, "c": 1}) == ["b", "a", "c"]
    slots = rank_slots(["n1", "n1", "n1"], {}, gpus_per_rank=0)  # a CPU learner: one node, as numbered
    assert [(s.bundle, s.local_rank, s.gpu_offset) for s in slots] == [(0, 0, 0), (1, 1, 0), (2, 2, 0)]


def test_more_gpu_bundles_on_a_node_than_it_has_is_refused():
    with pytest.raises(ValueError, match="node A holds 3 bundles of 1 GPUs, has 2"):
        rank_slots(["A", "A", "A"], {"A": 2}, gpus_per_rank=1)
