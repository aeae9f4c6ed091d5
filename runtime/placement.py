"""Which placement-group bundle each learner rank takes, so that a node's GPUs stay together and in order.

Ray places the bundles of a placement group where they fit, but their indices say nothing about nodes: with
four one-GPU bundles over two nodes, bundles 0 and 2 may share a node. A rank taking the bundle of its own
index would then put ranks 0 and 2 on node A and ranks 1 and 3 on node B, and every offset derived from the
rank (the local rank, the first GPU of a rank, the ranks of one engine replica) would be wrong. So the ranks
are handed out over the bundles here instead, node by node:

    slots = rank_slots(["B", "A", "B", "A"], {"A": 2, "B": 2}, gpus_per_rank=1)
    [s.bundle for s in slots]        # [1, 3, 0, 2]: ranks 0-1 on A (its bundles in index order), 2-3 on B
    [s.gpu_offset for s in slots]    # [0, 1, 0, 1]: each rank's first GPU index on its node

Nodes come in order of their GPU count (most first: the node that holds most ranks starts the count, as PACK
fills it first), then of their node id, so the order does not depend on how Ray numbered the bundles. Pure:
the caller reads the bundles' nodes from Ray (runtime/learner_group.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankSlot:
    rank: int
    bundle: int  # the placement-group bundle index the rank's actor is scheduled into
    node_id: str
    local_rank: int  # the rank's position among the ranks of its node
    gpu_offset: int  # the first of the rank's GPUs on its node: local_rank × gpus_per_rank


def node_order(node_ids: Sequence[str], node_gpus: Mapping[str, float]) -> list[str]:
    """The distinct nodes of `node_ids`, most GPUs first, then by node id."""
    return sorted(set(node_ids), key=lambda n: (-node_gpus.get(n, 0.0), n))


def rank_slots(
    bundle_nodes: Sequence[str], node_gpus: Mapping[str, float], gpus_per_rank: float
) -> list[RankSlot]:
    """One slot per bundle (bundle i placed on node `bundle_nodes[i]`), in rank order: ranks are numbered
    node by node (node_order), and within a node by bundle index, so each node's ranks are contiguous.

    Raises ValueError when a node holds more GPUs' worth of bundles than it has (a bundle's GPUs would not be
    on one node: Ray never does that, so the table read was wrong).
    """
    slots: list[RankSlot] = []
    for node in node_order(bundle_nodes, node_gpus):
        mine = [b for b, n in enumerate(bundle_nodes) if n == node]
        needed = len(mine) * gpus_per_rank
        if gpus_per_rank > 0 and needed > node_gpus.get(node, 0.0):
            have = node_gpus.get(node, 0.0)
            raise ValueError(f"node {node} holds {len(mine)} bundles of {gpus_per_rank:g} GPUs, has {have:g}")
        for local, bundle in enumerate(mine):
            offset = int(local * gpus_per_rank)
            slots.append(RankSlot(len(slots), bundle, node, local, offset))
    return slots
