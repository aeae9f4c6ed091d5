"""Tree packing: every stored token of a rollout tree forwarded once, and the path-by-path reference.

Tree-packed layout of one tree (docs/algorithm.md §2.4, docs/design.md §10.12)::

    packed  = [prompt | a_1 o_1 | a_2 o_2 | a'_2 o'_2 | ...]     node segments in topological order
    position_ids[t] = offset of t along its own root-to-t path       (branches restart at the branch point)
    allowed[t, u]   = u is in an ancestor segment of t's node, or u <= t in t's own segment
    target_index[t] = the token before t *on t's path*: t−1 inside a segment; for the first token of a node,
                      the last token of the nearest non-empty ancestor segment (the parent's obs tokens last)

so log π(y_t | h_t) = log_softmax(logits[target_index[t]])[y_t], exactly as in the root→leaf sequence.

Several trees per mini-batch, two layouts (`pack_trees(concat=...)`); the mask is kept as one [n, n] bool
block per tree (`blocks`), never as a batch-wide matrix:

    concat=True   all trees back to back in one unpadded row (block-diagonal). Used with the block-sparse
                  `learner.tree_attention`, whose cost is Σ chunk·|path| whatever the row length; padding
                  would only add work to every linear layer. The learner's default.
    concat=False  one padded row per tree, for the dense 4D float mask (eager/sdpa): dense attention then
                  costs Σ_b T_b² rather than (Σ_b T_b)². Pad tokens attend only to themselves (no all-masked
                  softmax row, so no NaN in the backward pass).

Every per-token array is [B, T] in the same layout, so the forward output lines up with all of them:

    turn_ids        flat turn index (tree b's turn j = node j+1 → turn_offset[b] + j), −1 off the loss
    owned           the copy of a loss token that trains it under §2.4 (each turn exactly once)
    pair_index/seq  (token copy, path) pairs for path methods (GRPO/GSPO/TreePO train every root-to-leaf
                    path fully): pair p is flat token index pair_index[p] under flat leaf pair_seq[p]

`pack_paths` builds the reference: one ordinary causal sequence per leaf (root→leaf, right-padded, no
custom mask, default positions); the loss sits on the turns that sequence owns (`full=False`, TreeOPSD) or on
every turn of the path (`full=True`, TreePO-style). A loss token whose context is empty (empty prompt, first
token) has no logits to read and is left out of the loss in both layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from system.tree import ROOT, RolloutTree


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """Model inputs and loss bookkeeping for B rows (trees, or paths). Shapes in the module docstring."""

    input_ids: torch.Tensor  # [B, T] long, pad 0
    position_ids: torch.Tensor | None  # [B, T] long; None = ordinary positions 0..T−1
    blocks: tuple[tuple[int, int, np.ndarray], ...] | None  # (row, start col, [n, n] bool allowed) per
    # tree; None = plain causal rows (pack_paths)
    valid: torch.Tensor  # [B, T] bool, a real (non-pad) token
    target_index: torch.Tensor  # [B, T] long, column whose logits predict the token; −1 = none
    turn_ids: torch.Tensor  # [B, T] long, −1 off the loss
    token_offset: torch.Tensor  # [B, T] long, index of the token inside its turn; −1 off the loss
    owned: torch.Tensor  # [B, T] bool
    behavior_logp: torch.Tensor  # [B, T] float32 stored μ log-probs (NaN off the loss)
    effective_mask: torch.Tensor  # [B, T] bool, loss token with a finite behavior log-prob (§10)
    pair_index: torch.Tensor  # [P] long, flat index into [B*T]
    pair_seq: torch.Tensor  # [P] long, flat leaf index
    q: torch.Tensor  # [n_turns] float64 teacher (1/2 where the tree has no credit)
    turn_tree: torch.Tensor  # [n_turns] long, tree index of each turn
    leaf_tree: torch.Tensor  # [n_leaves] long, tree index of each leaf
    leaf_reward: torch.Tensor  # [n_leaves] float64
    num_trees: int
    credited: bool  # every tree carries credit (q is the backup actor's teacher, not the 1/2 placeholder)

    @property
    def num_tokens(self) -> int:
        """Real tokens forwarded (what the model computes, padding excluded)."""
        return int(self.valid.sum())

    def dense_allowed(self) -> torch.Tensor | None:
        """[B, T, T] bool: the tree blocks on the diagonal; padding attends only to itself."""
        if self.blocks is None:
            return None
        b, t = self.input_ids.shape
        a = np.zeros((b, t, t), dtype=bool)
        a[:, np.arange(t), np.arange(t)] = True  # pads: no all-masked softmax row, so no NaN anywhere
        for row, start, block in self.blocks:
            n = block.shape[0]
            a[row, start : start + n, start : start + n] = block
        return torch.from_numpy(a)

    def additive_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """[B, 1, T, T] additive mask: 0 where allowed, the dtype's minimum elsewhere (float, not bool:
        a boolean 4D mask gives wrong results with eager attention, docs/design.md §10.12)."""
        allowed = self.dense_allowed()
        if allowed is None:
            return None
        zero = torch.zeros((), dtype=dtype)
        return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]

    def with_behavior_logp(self, logp: torch.Tensor) -> PackedBatch:
        """Copy whose μ log-probs are `logp` ([B, T], e.g. recomputed at θ_old) on the loss tokens."""
        on = self.turn_ids >= 0
        lp = torch.where(on, logp.detach().to(torch.float32), self.behavior_logp)
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        fields.update(behavior_logp=lp, effective_mask=on & torch.isfinite(lp))
        return PackedBatch(**fields)


@dataclass
class _Row:
    """One row being built (numpy)."""

    ids: list[np.ndarray]
    pos: list[np.ndarray]
    target: list[np.ndarray]
    turn: list[np.ndarray]
    offset: list[np.ndarray]
    owned: list[np.ndarray]
    blp: list[np.ndarray]
    pairs: list[tuple[np.ndarray, int]]  # (columns, flat leaf)
    allowed: np.ndarray | None = None


def _segments(tree: RolloutTree) -> tuple[np.ndarray, dict[int, tuple[int, int]]]:
    """Topological order and each node's [start, end) in the packed row."""
    spans, start = {}, 0
    order = tree.topological_order
    for i in order:
        n = tree.nodes[i]
        end = start + len(n.tokens) + len(n.obs_tokens)
        spans[int(i)] = (start, end)
        start = end
    return order, spans


def _node_loss(tree: RolloutTree, i: int, target: np.ndarray) -> np.ndarray:
    """Loss flag over node i's turn tokens: loss_mask and a readable context (target ≥ 0)."""
    return tree.nodes[i].loss_mask & (target[: len(tree.nodes[i].tokens)] >= 0)


def _tree_row(tree: RolloutTree, turn_offset: int, leaf_offset: int) -> _Row:
    order, spans = _segments(tree)
    row = _Row([], [], [], [], [], [], [], [])
    base: dict[int, int] = {}  # position of a node's first token
    last: dict[int, int] = {}  # last packed index on the path up to and including the node (−1 = none)
    loss_cols: dict[int, np.ndarray] = {}
    for i in map(int, order):
        n = tree.nodes[i]
        start, end = spans[i]
        par = n.parent
        base[i] = 0 if par < 0 else base[par] + spans[par][1] - spans[par][0]
        prev = -1 if par < 0 else last[par]
        last[i] = end - 1 if end > start else prev
        cols = np.arange(start, end)
        target = np.concatenate([[prev], cols[:-1]]) if end > start else cols
        row.ids += [n.tokens, n.obs_tokens]
        row.pos.append(base[i] + np.arange(end - start))
        row.target.append(target)
        _append_turn_fields(row, tree, i, target, turn_offset, owned=True)
        loss_cols[i] = start + np.flatnonzero(_node_loss(tree, i, target)) if i != ROOT else cols[:0]
    for k, leaf in enumerate(tree.leaves):
        path_cols = [loss_cols[j] for j in tree.path(int(leaf))]
        row.pairs.append((np.concatenate(path_cols), leaf_offset + k))
    row.allowed = _allowed(tree, spans)
    return row


def _allowed(tree: RolloutTree, spans: dict[int, tuple[int, int]]) -> np.ndarray:
    """[n, n] bool: each node segment sees its ancestors' segments whole and itself causally."""
    n = max(end for _, end in spans.values())
    allowed = np.zeros((n, n), dtype=bool)
    for i, (start, end) in spans.items():
        j = tree.nodes[i].parent
        while j >= 0:
            s, e = spans[j]
            allowed[start:end, s:e] = True
            j = tree.nodes[j].parent
        allowed[start:end, start:end] = np.tri(end - start, dtype=bool)
    return allowed


def _append_turn_fields(
    row: _Row, tree: RolloutTree, i: int, target: np.ndarray, turn_offset: int, owned: bool
) -> None:
    """turn ids, offsets, owner flags and μ log-probs for node i's segment (turn tokens then obs tokens)."""
    n = tree.nodes[i]
    size, obs = len(n.tokens), len(n.obs_tokens)
    loss = _node_loss(tree, i, target) if i != ROOT else np.zeros(0, bool)
    turn = np.where(loss, turn_offset + i - 1, -1)
    row.turn += [turn, np.full(obs, -1)]
    row.offset += [np.where(loss, np.arange(size), -1), np.full(obs, -1)]
    row.owned += [loss & owned, np.zeros(obs, bool)]
    row.blp += [np.where(loss, n.behavior_logprobs, np.nan), np.full(obs, np.nan)]


def _path_rows(tree: RolloutTree, turn_offset: int, leaf_offset: int, full: bool) -> list[_Row]:
    rows = []
    for k, leaf in enumerate(tree.leaves):
        row = _Row([], [], [], [], [], [], [], [])
        start, cols_loss = 0, []
        for i in [ROOT, *tree.path(int(leaf))]:
            n = tree.nodes[i]
            end = start + len(n.tokens) + len(n.obs_tokens)
            target = np.arange(start, end) - 1
            row.ids += [n.tokens, n.obs_tokens]
            row.target.append(target)
            owns = i != ROOT and tree.owner_leaf[i] == leaf
            _append_turn_fields(row, tree, i, target, turn_offset, owned=owns)
            if not (full or owns):  # owner mode: loss only on the turns this sequence owns
                row.turn[-2] = np.full(len(n.tokens), -1)
                row.offset[-2] = np.full(len(n.tokens), -1)
            if i != ROOT:
                cols_loss.append(start + np.flatnonzero(row.turn[-2] >= 0))
            start = end
        row.pos = [np.arange(start)]
        row.pairs.append((np.concatenate(cols_loss), leaf_offset + k))
        rows.append(row)
    return rows


def _concat(rows: Sequence[_Row]) -> tuple[_Row, list[int]]:
    """Trees back to back in one row (block-diagonal); returns the row and each tree's start column."""
    out, starts, start = _Row([], [], [], [], [], [], [], []), [], 0
    for r in rows:
        starts.append(start)
        for f in ("ids", "pos", "turn", "offset", "owned", "blp"):
            getattr(out, f).extend(getattr(r, f))
        out.target += [np.where(t >= 0, t + start, -1) for t in r.target]
        out.pairs += [(cols + start, leaf) for cols, leaf in r.pairs]
        start += sum(len(x) for x in r.ids)
    return out, starts


def _collate(rows: Sequence[_Row], trees: Sequence[RolloutTree], blocks) -> PackedBatch:
    fields = ("ids", "pos", "target", "turn", "offset", "owned", "blp")
    cat = [{f: np.concatenate(getattr(r, f)) for f in fields} for r in rows]
    b, t = len(rows), max(1, max(len(c["ids"]) for c in cat))

    def grid(field: str, fill, dtype) -> torch.Tensor:
        out = np.full((b, t), fill, dtype=dtype)
        for r, c in enumerate(cat):
            out[r, : len(c[field])] = c[field]
        return torch.from_numpy(out)

    pair_index = [r * t + cols for r, row in enumerate(rows) for cols, _ in row.pairs]
    pair_seq = [np.full(len(cols), leaf) for row in rows for cols, leaf in row.pairs]
    turn_ids = grid("turn", -1, np.int64)
    blp = grid("blp", np.nan, np.float32)
    return PackedBatch(
        input_ids=grid("ids", 0, np.int64),
        position_ids=grid("pos", 0, np.int64) if blocks is not None else None,
        blocks=blocks,
        valid=torch.from_numpy(np.arange(t)[None, :] < np.array([len(c["ids"]) for c in cat])[:, None]),
        target_index=grid("target", -1, np.int64),
        turn_ids=turn_ids,
        token_offset=grid("offset", -1, np.int64),
        owned=grid("owned", False, bool),
        behavior_logp=blp,
        effective_mask=(turn_ids >= 0) & torch.isfinite(blp),
        pair_index=torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *pair_index]).astype(np.int64)),
        pair_seq=torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *pair_seq]).astype(np.int64)),
        **_tree_fields(trees),
    )


def _tree_fields(trees: Sequence[RolloutTree]) -> dict:
    q = [tr.credit.q[1:] if tr.credit is not None else np.full(len(tr.nodes) - 1, 0.5) for tr in trees]
    return {
        "q": torch.from_numpy(np.concatenate([np.zeros(0), *q]).astype(np.float64)),
        "turn_tree": torch.from_numpy(np.repeat(np.arange(len(trees)), [len(tr.nodes) - 1 for tr in trees])),
        "leaf_tree": torch.from_numpy(np.repeat(np.arange(len(trees)), [tr.num_leaves for tr in trees])),
        "leaf_reward": torch.from_numpy(
            np.concatenate([np.zeros(0), *[tr.leaf_rewards() for tr in trees]]).astype(np.float64)
        ),
        "num_trees": len(trees),
        "credited": all(tr.credit is not None for tr in trees),
    }


def _offsets(trees: Sequence[RolloutTree]) -> tuple[np.ndarray, np.ndarray]:
    turns = np.cumsum([0, *[len(tr.nodes) - 1 for tr in trees]])
    leaves = np.cumsum([0, *[tr.num_leaves for tr in trees]])
    return turns, leaves


def pack_trees(trees: Sequence[RolloutTree], concat: bool = False) -> PackedBatch:
    """Tree-packed batch holding every stored token of every tree exactly once.

    concat=False: one padded row per tree (for dense-mask attention: cost Σ_b T_b²);
    concat=True: all trees back to back in one row, no padding (for `tree_attention`, which never
    materializes the mask, so the row length costs nothing and padding would be pure waste).
    """
    turns, leaves = _offsets(trees)
    rows = [_tree_row(tr, int(turns[b]), int(leaves[b])) for b, tr in enumerate(trees)]
    if concat:
        row, starts = _concat(rows)
        return _collate([row], trees, tuple((0, s, r.allowed) for s, r in zip(starts, rows, strict=True)))
    return _collate(rows, trees, tuple((b, 0, r.allowed) for b, r in enumerate(rows)))


def pack_tree(tree: RolloutTree) -> PackedBatch:
    """One tree packed into one row (`pack_trees([tree])`)."""
    return pack_trees([tree])


def pack_paths(
    trees: RolloutTree | Sequence[RolloutTree], full: bool = False, concat: bool = False
) -> PackedBatch:
    """Path-by-path reference: one causal sequence per leaf (trees in order, leaves ascending).

    full=False: loss on the turns the sequence owns (TreeOPSD, §2.4); full=True: on every turn of the path
    (TreePO/GRPO/GSPO), `owned` still marks the owner copy.
    concat=False: right-padded rows, plain causal attention, default positions (the reference);
    concat=True: the sequences back to back in one row as causal blocks ("varlen", no padding) for
    `tree_attention`: the same attention kernel as the tree-packed forward, only the prefixes repeat.
    """
    trees = [trees] if isinstance(trees, RolloutTree) else list(trees)
    turns, leaves = _offsets(trees)
    rows = [r for b, tr in enumerate(trees) for r in _path_rows(tr, int(turns[b]), int(leaves[b]), full)]
    if not concat:
        return _collate(rows, trees, None)
    for r in rows:
        n = len(r.pos[0])
        r.allowed = np.tri(n, dtype=bool)
    row, starts = _concat(rows)
    return _collate([row], trees, tuple((0, s, r.allowed) for s, r in zip(starts, rows, strict=True)))


def canonical_logp(packed: PackedBatch, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of the owned loss tokens sorted by (turn, offset in turn): the same key list for
    `pack_trees` and `pack_paths` of the same trees, so their log-probs compare elementwise."""
    sel = packed.owned & (packed.turn_ids >= 0)
    keys = packed.turn_ids[sel] * (1 << 32) + packed.token_offset[sel]
    order = torch.argsort(keys)
    return keys[order], logp[sel][order]


def turn_logp_sums(packed: PackedBatch, logp: torch.Tensor) -> torch.Tensor:
    """[n_turns] Σ_t log π over each turn's owned loss tokens."""
    sel = packed.owned & (packed.turn_ids >= 0)
    out = torch.zeros(packed.q.shape[0], dtype=logp.dtype)
    return out.index_add(0, packed.turn_ids[sel], logp[sel])
