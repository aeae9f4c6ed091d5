"""Token-budget micro-batches of a mini-batch of trees (`learner.max_tokens_per_microbatch`; pure planning).

    pieces = [p for b, t in enumerate(trees) for p in split_tree(b, t, budget)]
    micro = first_fit_decreasing(pieces, budget)       # lists of pieces, each list one forward/backward

A piece is a subtree to forward: the nodes it *owns* (whose turns it trains: each node of a tree is owned by
exactly one piece) plus their ancestors as *context* (forwarded again, not trained), so every owned token
sees exactly its own root-to-token path, as in the whole tree. A tree that fits the budget is one piece. A
larger one is cut at its children: a node's piece takes whole child subtrees while they fit and sends the
others to pieces of their own, which carry the node and its ancestors as context; a node beside which no
child fits is owned by its first split child's piece instead (which forwards it anyway). Only a node too long
for the budget with its context makes a piece over budget (with the chain of ancestors merged into it). The
prefix a piece recomputes is `context` tokens (`recomputed_tokens`). Pieces are then packed into
micro-batches first-fit-decreasing by their tokens.

A restart (system/tree.py: a compaction's new context) always starts pieces of its own, with no ancestor as
context, since its turns see none. A root-to-leaf path that crosses one is then trained in parts, one per
context (learner/packing.py); with a token budget they may land in different micro-batches, where GSPO's
sequence-level ratio is taken per part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from system.tree import ROOT, RolloutTree


@dataclass(frozen=True)
class Piece:
    tree: int  # index of the tree in the mini-batch
    nodes: tuple[int, ...]  # every node forwarded, parents before children (pre-order)
    owned: frozenset[int]  # the nodes it trains; the rest of `nodes` is context
    tokens: int  # tokens forwarded (owned + context)
    context: int  # tokens of the context nodes (the recomputed prefix)


def node_tokens(tree: RolloutTree) -> list[int]:
    """Packed tokens of each node: its turn tokens and its observation tokens (the prompt for the root)."""
    return [len(n.tokens) + len(n.obs_tokens) for n in tree.nodes]


def _kids(tree: RolloutTree, node: int) -> tuple[int, ...]:
    """`node`'s children in its own context: a restart child opens another (system/tree.py)."""
    kids = tree.children[node]
    return tuple(c for c in kids if c not in tree.restarts) if tree.restarts else kids


def _subtree(tree: RolloutTree, node: int) -> list[int]:
    out, stack = [], [node]
    while stack:
        i = stack.pop()
        out.append(i)
        stack.extend(reversed(_kids(tree, i)))
    return out


def split_tree(index: int, tree: RolloutTree, budget: int) -> list[Piece]:
    """The pieces of one tree under `budget` tokens (budget ≤ 0: the whole tree); see the module docstring.
    A restart's subtree is always a piece (or pieces) of its own, without the ancestors it does not see."""
    sizes = node_tokens(tree)
    sub = [0] * len(sizes)
    for i in reversed(tree.topological_order):
        sub[int(i)] = sizes[int(i)] + sum(sub[c] for c in _kids(tree, int(i)))
    if not tree.restarts and (budget <= 0 or sub[ROOT] <= budget):
        return [_piece(index, tree, list(map(int, tree.topological_order)), sizes, ())]
    owned_sets: list[tuple[list[int], tuple[int, ...]]] = []
    for start in (int(i) for i in tree.topological_order if i == ROOT or i in tree.restarts):
        if budget <= 0 or sub[start] <= budget:
            owned_sets.append((_subtree(tree, start), ()))
        else:
            _split(tree, start, (), sizes, sub, budget, owned_sets)
    return [_piece(index, tree, owned, sizes, path) for owned, path in owned_sets]


def _split(tree, node, path, sizes, sub, budget, out) -> int:  # type: ignore[no-untyped-def]
    """Appends (owned nodes, context path) pieces for `node`'s subtree, `path` = its ancestors (root first);
    returns the index in `out` of the piece that owns `node`."""
    context = sum(sizes[a] for a in path)
    if context + sub[node] <= budget:
        out.append((_subtree(tree, node), path))
        return len(out) - 1
    owned, used, first_split = [node], context + sizes[node], None
    for child in _kids(tree, node):
        if used + sub[child] <= budget:
            owned += _subtree(tree, child)
            used += sub[child]
            continue
        k = _split(tree, child, (*path, node), sizes, sub, budget, out)
        first_split = k if first_split is None else first_split
    if len(owned) == 1 and first_split is not None:
        # Nothing fitted beside the node: the first split child's piece forwards it as context already, so
        # it owns it there instead of in a piece of its own (the node's context is not forwarded again).
        nodes, child_path = out[first_split]
        out[first_split] = ([node, *nodes], child_path[:-1])
        return first_split
    out.append((owned, path))
    return len(out) - 1


def _piece(index: int, tree: RolloutTree, owned: list[int], sizes: list[int], path: Sequence[int]) -> Piece:
    keep = set(owned) | set(path)
    order = tuple(int(i) for i in tree.topological_order if int(i) in keep)
    context = sum(sizes[a] for a in path)
    return Piece(index, order, frozenset(owned), sum(sizes[i] for i in order), context)


def first_fit_decreasing(pieces: Sequence[Piece], budget: int) -> list[list[Piece]]:
    """Pieces into as few micro-batches of ≤ `budget` tokens as first-fit-decreasing finds (one per piece
    that is over budget alone); budget ≤ 0: everything in one micro-batch. Order inside a micro-batch: by
    tree, then by the piece's first node, so that a tree that fits stays contiguous."""
    if budget <= 0:
        return [sorted(pieces, key=lambda p: (p.tree, p.nodes[0]))] if pieces else []
    bins: list[list[Piece]] = []
    room: list[int] = []
    for p in sorted(pieces, key=lambda p: (-p.tokens, p.tree, p.nodes[0])):
        for k, free in enumerate(room):
            if p.tokens <= free:
                bins[k].append(p)
                room[k] -= p.tokens
                break
        else:
            bins.append([p])
            room.append(budget - p.tokens)
    return [sorted(b, key=lambda p: (p.tree, p.nodes[0])) for b in bins]


def recomputed_tokens(plan: Sequence[Sequence[Piece]]) -> int:
    """Context tokens forwarded again because their tree was split (0 when every tree fits)."""
    return sum(p.context for micro in plan for p in micro)


def loss_token_counts(tree: RolloutTree) -> list[int]:
    """Per node, its turn tokens that carry loss: loss mask on, a finite behavior log-prob, and a context to
    be predicted from (only a tree whose prompt and first turns are empty has a token without one). These
    counts make the normalizers of a mini-batch (each turn's ℓ_i; each path's tokens) without a forward."""
    counts, before = [0] * len(tree.nodes), [0] * len(tree.nodes)
    for i in map(int, tree.topological_order):
        n = tree.nodes[i]
        par = n.parent
        before[i] = (  # a restart's turns see its context only (system/tree.py)
            0
            if par < 0 or i in tree.restarts
            else before[par] + len(tree.nodes[par].tokens) + len(tree.nodes[par].obs_tokens)
        )
        if i == ROOT:
            continue
        ok = n.loss_mask & np.isfinite(n.behavior_logprobs)
        if before[i] == 0 and len(ok):
            ok = ok.copy()
            ok[0] = False  # the first token of the row has no logits to be read from
        counts[i] = int(ok.sum())
    return counts


def path_token_counts(tree: RolloutTree, counts: Sequence[int]) -> list[int]:
    """Per leaf (ascending node id), the loss tokens on its root-to-leaf path: what a path loss trains."""
    return [sum(counts[j] for j in tree.path(int(leaf))) for leaf in tree.leaves]
