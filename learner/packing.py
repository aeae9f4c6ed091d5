"""Tree packing: every stored token of a rollout tree forwarded once, and the path-by-path reference.

Tree-packed layout of one tree (or one piece of it, system/microbatch.py; docs/algorithm.md §2.4)::

    packed  = [prompt | a_1 o_1 | a_2 o_2 | a'_2 o'_2 | ...]     node segments in pre-order (DFS)
    position_ids[t] = offset of t along its own root-to-t path       (branches restart at the branch point)
    reach[t]        = end of t's node's subtree in the row: t is seen by exactly the queries q with
                      t ≤ q < reach[t] (its later tokens in the node, and every descendant, nothing else)
    target_index[t] = the token before t *on t's path*: t−1 inside a segment; for the first token of a node,
                      the last token of the nearest non-empty ancestor segment (the parent's obs tokens last)

so log π(y_t | h_t) = log_softmax(logits[target_index[t]])[y_t], exactly as in the root→leaf sequence.
Pre-order is what makes one number per token enough: a node's subtree is one contiguous stretch of the row.
No T×T mask is ever stored: the block-sparse attention (learner/tree_attention.py) reads the segments,
flex attention (learner/flex_attention.py) the reach; `dense_allowed()` builds the mask on demand for the
model's own eager/sdpa attention, the reference.

Layouts (`concat`): True, everything back to back in one unpadded row (block-sparse and flex attention; the
learner's default); False, one padded row per tree or piece (dense-mask attention costs Σ_b T_b²).

Every per-token array is [B, T] in the same layout, so the forward output lines up with all of them:

    turn_ids        turn index (tree k's turn j = node j+1 → turn_offset[k] + j), −1 off the loss
    owned           the copy of a loss token that trains it under §2.4 (each turn exactly once); the
                    context nodes of a piece carry turn ids (path losses read them) but are not owned
    pair_index/seq  (token copy, path) pairs for path methods (GRPO/GSPO/TreePO train every root-to-leaf
                    path fully): pair p is flat token index pair_index[p] under leaf pair_seq[p]

Turns and leaves are numbered per batch; `turn_tree`/`turn_node` and `leaf_tree`/`leaf_node` say which tree
of the mini-batch (its index in the list given) and which node each is, so per-tree quantities (teacher,
advantages, weights) computed once for a mini-batch can be gathered for any of its micro-batches.
`pack_paths` builds the reference: one ordinary causal sequence per leaf (root→leaf, right-padded, default
positions; one per context it crosses: restarts, system/tree.py); the loss sits on the turns that sequence
owns (`full=False`, TreeOPSD) or on every turn of the path (`full=True`). A loss token whose context is
empty (empty prompt, first token) has no logits to read and is left out of the loss in both layouts.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from system.microbatch import Piece, split_tree
from system.tree import ROOT, RolloutTree

Segment = tuple[int, int, int, int]  # (row, start, end, parent segment index or −1)


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """Model inputs and loss bookkeeping for B rows (trees, pieces or paths). Module docstring: shapes."""

    input_ids: torch.Tensor  # [B, T] long, pad 0
    position_ids: torch.Tensor | None  # [B, T] long; None = ordinary positions 0..T−1
    reach: torch.Tensor | None  # [B, T] long (module docstring); None = plain causal rows (pack_paths)
    segments: tuple[Segment, ...] | None  # node segments (or causal blocks) for the block-sparse plan
    valid: torch.Tensor  # [B, T] bool, a real (non-pad) token
    target_index: torch.Tensor  # [B, T] long, column whose logits predict the token; −1 = none
    turn_ids: torch.Tensor  # [B, T] long, −1 off the loss
    token_offset: torch.Tensor  # [B, T] long, index of the token inside its turn; −1 off the loss
    owned: torch.Tensor  # [B, T] bool
    behavior_logp: torch.Tensor  # [B, T] float32 stored μ log-probs (NaN off the loss)
    effective_mask: torch.Tensor  # [B, T] bool, loss token with a finite behavior log-prob (§10)
    pair_index: torch.Tensor  # [P] long, flat index into [B*T]
    pair_seq: torch.Tensor  # [P] long, leaf index
    q: torch.Tensor  # [n_turns] float64 teacher (1/2 where the tree has no credit)
    turn_tree: torch.Tensor  # [n_turns] long, mini-batch tree index of each turn
    turn_node: torch.Tensor  # [n_turns] long, node id of each turn
    turn_version: torch.Tensor  # [n_turns] long, the policy version that sampled each turn
    leaf_tree: torch.Tensor  # [n_leaves] long
    leaf_node: torch.Tensor  # [n_leaves] long
    leaf_reward: torch.Tensor  # [n_leaves] float64
    num_trees: int
    credited: bool  # every tree carries credit (q is the backup actor's teacher, not the 1/2 placeholder)
    _cache: dict = field(default_factory=dict, repr=False)  # per-batch plans (attention), built once
    proximal_logp: torch.Tensor | None = None  # [B, T] π_prox log-probs (algo.proximal=step_start), or None

    @property
    def num_tokens(self) -> int:
        """Real tokens forwarded (what the model computes, padding excluded)."""
        return int(self.valid.sum())

    def dense_allowed(self) -> torch.Tensor | None:
        """[B, T, T] bool built on demand from `reach` (the reference; never used by the default forward);
        padding attends only to itself, so no softmax row is all-masked."""
        if self.reach is None:
            return None
        t = self.input_ids.shape[1]
        q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
        allowed = (k <= q) & (q < self.reach[:, None, :]) & self.valid[:, None, :]
        return allowed | (torch.eye(t, dtype=torch.bool) & ~self.valid[:, :, None])

    def additive_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """[B, 1, T, T] additive mask: 0 where allowed, the dtype's minimum elsewhere (float, not bool:
        a boolean 4D mask gives wrong results with eager attention, docs/design.md §10.12)."""
        allowed = self.dense_allowed()
        if allowed is None:
            return None
        return torch.where(allowed, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)[:, None]

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on `device` (itself when they are there already)."""
        if self.input_ids.device == torch.device(device):
            return self
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "_cache"}
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
        return PackedBatch(**moved)

    def padded_to(self, length: int) -> PackedBatch:
        """A copy whose rows are `length` long (the flex kernel's buckets, learner/flex_attention.py): the
        added columns are padding (id 0, no loss, not valid) that attend to themselves only (reach = own
        column + 1); `pair_index` is renumbered for the wider rows. Itself when already that long."""
        b, t = self.input_ids.shape
        if length == t:
            return self
        if length < t or self.reach is None:
            raise ValueError(f"can only pad a tree-layout batch to at least its {t} columns, not {length}")
        extra = length - t

        def widen(x: torch.Tensor, fill: object) -> torch.Tensor:
            return torch.cat([x, torch.full((b, extra), fill, dtype=x.dtype, device=x.device)], dim=1)

        cols = torch.arange(t, length, device=self.reach.device)
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "_cache"}
        fields.update(
            input_ids=widen(self.input_ids, 0),
            position_ids=None if self.position_ids is None else widen(self.position_ids, 0),
            reach=torch.cat([self.reach, (cols + 1).expand(b, extra)], dim=1),
            valid=widen(self.valid, False),
            target_index=widen(self.target_index, -1),
            turn_ids=widen(self.turn_ids, -1),
            token_offset=widen(self.token_offset, -1),
            owned=widen(self.owned, False),
            behavior_logp=widen(self.behavior_logp, float("nan")),
            proximal_logp=None if self.proximal_logp is None else widen(self.proximal_logp, float("nan")),
            effective_mask=widen(self.effective_mask, False),
            pair_index=self.pair_index // t * length + self.pair_index % t,
        )
        return PackedBatch(**fields)

    def with_behavior_logp(self, logp: torch.Tensor) -> PackedBatch:
        """Copy whose μ log-probs are `logp` ([B, T], e.g. recomputed at θ_old) on the loss tokens."""
        on = self.turn_ids >= 0
        lp = torch.where(on, logp.detach().to(device=on.device, dtype=torch.float32), self.behavior_logp)
        return replace(self, behavior_logp=lp, effective_mask=on & torch.isfinite(lp))

    def with_proximal_logp(self, logp: torch.Tensor) -> PackedBatch:
        """Copy carrying π_prox's log-probs ([B, T], scored when the step starts): the losses' reference."""
        return replace(self, proximal_logp=logp.detach().to(device=self.turn_ids.device, dtype=torch.float32))


@dataclass
class _Row:
    """One row being built (numpy)."""

    ids: list[np.ndarray] = field(default_factory=list)
    pos: list[np.ndarray] = field(default_factory=list)
    reach: list[np.ndarray] = field(default_factory=list)
    target: list[np.ndarray] = field(default_factory=list)
    turn: list[np.ndarray] = field(default_factory=list)
    offset: list[np.ndarray] = field(default_factory=list)
    owned: list[np.ndarray] = field(default_factory=list)
    blp: list[np.ndarray] = field(default_factory=list)
    pairs: list[tuple[np.ndarray, int]] = field(default_factory=list)  # (columns, leaf)
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, parent segment)


def _node_loss(tree: RolloutTree, i: int, target: np.ndarray) -> np.ndarray:
    """Loss flag over node i's turn tokens: loss_mask and a readable context (target ≥ 0)."""
    return tree.nodes[i].loss_mask & (target[: len(tree.nodes[i].tokens)] >= 0)


def _append_turn_fields(
    row: _Row, tree: RolloutTree, i: int, target: np.ndarray, turn: int, owned: bool
) -> None:
    """turn ids, offsets, owner flags and μ log-probs for node i's segment (turn tokens then obs tokens)."""
    n = tree.nodes[i]
    size, obs = len(n.tokens), len(n.obs_tokens)
    loss = _node_loss(tree, i, target) if i != ROOT else np.zeros(0, bool)
    row.turn += [np.where(loss, turn, -1), np.full(obs, -1)]
    row.offset += [np.where(loss, np.arange(size), -1), np.full(obs, -1)]
    row.owned += [loss & owned, np.zeros(obs, bool)]
    row.blp += [np.where(loss, n.behavior_logprobs, np.nan), np.full(obs, np.nan)]


def _piece_row(tree: RolloutTree, piece: Piece, start: int, turn_offset: int, leaf_offset: int) -> _Row:
    """One tree piece packed from column `start` of a row (pre-order segments; module docstring)."""
    row, spans, base, last, seg_of, loss_cols = _Row(), {}, {}, {}, {}, {}
    col = start
    for i in piece.nodes:
        n = tree.nodes[i]
        end = col + len(n.tokens) + len(n.obs_tokens)
        spans[i], par = (col, end), n.parent if n.parent in spans else -1  # a restart starts a context
        base[i] = 0 if par < 0 else base[par] + spans[par][1] - spans[par][0]
        prev = -1 if par < 0 else last[par]
        last[i] = end - 1 if end > col else prev
        cols = np.arange(col, end)
        target = np.concatenate([[prev], cols[:-1]]) if end > col else cols
        row.ids += [n.tokens, n.obs_tokens]
        row.pos.append(base[i] + np.arange(end - col))
        row.target.append(target)
        _append_turn_fields(row, tree, i, target, turn_offset + i - 1, owned=i in piece.owned)
        loss_cols[i] = col + np.flatnonzero(_node_loss(tree, i, target)) if i != ROOT else cols[:0]
        seg_of[i] = len(row.segments)
        row.segments.append((col, end, seg_of[par] if par >= 0 else -1))
        col = end
    reach = {i: spans[i][1] for i in piece.nodes}
    for i in reversed(piece.nodes):  # a node's subtree ends where its last descendant's segment ends
        par = tree.nodes[i].parent
        if par >= 0 and par in reach:
            reach[par] = max(reach[par], reach[i])
    row.reach = [np.full(spans[i][1] - spans[i][0], reach[i]) for i in piece.nodes]
    for k, leaf in enumerate(int(x) for x in tree.leaves):  # a path's run in each context it crosses
        for run in (r for r in tree.context_runs(leaf) if r[-1] in piece.owned):
            row.pairs.append((np.concatenate([loss_cols[j] for j in run]), leaf_offset + k))
    return row


def _collate(
    rows: Sequence[_Row], trees: Sequence[RolloutTree], layout: str, used: Sequence[int]
) -> PackedBatch:
    """`layout`: "tree" (segments and reach kept), or "causal" (plain causal rows)."""
    fields = ("ids", "pos", "reach", "target", "turn", "offset", "owned", "blp")
    cat = [{f: np.concatenate([np.zeros(0, np.int64), *getattr(r, f)]) for f in fields} for r in rows]
    b, t = len(rows), max(1, max(len(c["ids"]) for c in cat))

    def grid(name: str, fill: object, dtype: type) -> torch.Tensor:
        out = np.full((b, t), fill, dtype=dtype)
        for r, c in enumerate(cat):
            out[r, : len(c[name])] = c[name]
        return torch.from_numpy(out)

    pair_index = [r * t + cols for r, row in enumerate(rows) for cols, _ in row.pairs]
    pair_seq = [np.full(len(cols), leaf) for row in rows for cols, leaf in row.pairs]
    turn_ids, blp = grid("turn", -1, np.int64), grid("blp", np.nan, np.float32)
    tree_layout = layout == "tree"
    first = np.cumsum([0, *(len(row.segments) for row in rows)])  # parents numbered over all rows
    segments = tuple(
        (r, s, e, p + int(first[r]) if p >= 0 else -1)
        for r, row in enumerate(rows)
        for s, e, p in row.segments
    )
    return PackedBatch(
        input_ids=grid("ids", 0, np.int64),
        position_ids=grid("pos", 0, np.int64) if tree_layout else None,
        reach=grid("reach", 0, np.int64) if tree_layout else None,
        segments=segments if tree_layout else None,
        valid=torch.from_numpy(np.arange(t)[None, :] < np.array([len(c["ids"]) for c in cat])[:, None]),
        target_index=grid("target", -1, np.int64),
        turn_ids=turn_ids,
        token_offset=grid("offset", -1, np.int64),
        owned=grid("owned", False, bool),
        behavior_logp=blp,
        effective_mask=(turn_ids >= 0) & torch.isfinite(blp),
        pair_index=torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *pair_index]).astype(np.int64)),
        pair_seq=torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *pair_seq]).astype(np.int64)),
        **_tree_fields(trees, used),
    )


def _tree_fields(trees: Sequence[RolloutTree], used: Sequence[int]) -> dict:
    """Per-turn and per-leaf fields of the trees `used` (indices into `trees`), in that order."""
    sub = [trees[k] for k in used]
    q = [t.credit.q[1:] if t.credit is not None else np.full(len(t.nodes) - 1, 0.5) for t in sub]

    def cat(parts: list[np.ndarray], dtype: type) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([np.zeros(0, dtype), *parts]).astype(dtype))

    return {
        "q": cat(q, np.float64),
        "turn_tree": cat([np.full(len(t.nodes) - 1, k) for k, t in zip(used, sub, strict=True)], np.int64),
        "turn_node": cat([np.arange(1, len(t.nodes)) for t in sub], np.int64),
        "turn_version": cat([t.versions for t in sub], np.int64),
        "leaf_tree": cat([np.full(t.num_leaves, k) for k, t in zip(used, sub, strict=True)], np.int64),
        "leaf_node": cat([t.leaves for t in sub], np.int64),
        "leaf_reward": cat([t.leaf_rewards() for t in sub], np.float64),
        "num_trees": len(sub),
        "credited": all(t.credit is not None for t in sub),
    }


def _offsets(trees: Sequence[RolloutTree], used: Sequence[int]) -> tuple[dict[int, int], dict[int, int]]:
    turns, leaves, t, lf = {}, {}, 0, 0
    for k in used:
        turns[k], leaves[k] = t, lf
        t, lf = t + len(trees[k].nodes) - 1, lf + trees[k].num_leaves
    return turns, leaves


def pack_pieces(trees: Sequence[RolloutTree], pieces: Sequence[Piece], concat: bool = True) -> PackedBatch:
    """The given pieces of `trees` (system/microbatch.py), tree-packed: back to back in one row (`concat`)
    or one padded row per piece."""
    used = list(dict.fromkeys(p.tree for p in pieces))
    turns, leaves = _offsets(trees, used)
    rows, col = [], 0
    for p in pieces:
        row = _piece_row(trees[p.tree], p, col if concat else 0, turns[p.tree], leaves[p.tree])
        rows.append(row)
        col += sum(len(x) for x in row.ids)
    if concat:
        rows = [_merge(rows)]
    return _collate(rows, trees, "tree", used)


def _merge(rows: Sequence[_Row]) -> _Row:
    """Rows already laid out at their columns, as one row (segment parents renumbered)."""
    out, seen = _Row(), 0
    for r in rows:
        for f in ("ids", "pos", "reach", "target", "turn", "offset", "owned", "blp", "pairs"):
            getattr(out, f).extend(getattr(r, f))
        out.segments += [(s, e, p + seen if p >= 0 else -1) for s, e, p in r.segments]
        seen += len(r.segments)
    return out


def pack_trees(trees: Sequence[RolloutTree], concat: bool = False) -> PackedBatch:
    """Every stored token of every tree once: its pieces (one, or one per context with restarts)."""
    return pack_pieces(trees, [p for k, t in enumerate(trees) for p in split_tree(k, t, 0)], concat)


def pack_tree(tree: RolloutTree) -> PackedBatch:  # `pack_trees([tree])`
    return pack_trees([tree])


def _path_row(
    tree: RolloutTree, run: list[int], leaf: int, turn_offset: int, leaf_index: int, full: bool, start: int
) -> _Row:
    row, col, cols_loss = _Row(), start, []
    for i in run:
        n = tree.nodes[i]
        end = col + len(n.tokens) + len(n.obs_tokens)
        target = np.where(np.arange(col, end) - 1 >= start, np.arange(col, end) - 1, -1)
        row.ids += [n.tokens, n.obs_tokens]
        row.target.append(target)
        owns = i != ROOT and tree.owner_leaf[i] == leaf
        _append_turn_fields(row, tree, i, target, turn_offset + i - 1, owned=owns)
        if not (full or owns):  # owner mode: loss only on the turns this sequence owns
            row.turn[-2] = np.full(len(n.tokens), -1)
            row.offset[-2] = np.full(len(n.tokens), -1)
        if i != ROOT:
            cols_loss.append(col + np.flatnonzero(row.turn[-2] >= 0))
        col = end
    row.pos, row.reach = [np.arange(col - start)], [np.full(col - start, col)]  # one causal block
    row.segments = [(start, col, -1)]
    row.pairs.append((np.concatenate([np.zeros(0, np.int64), *cols_loss]), leaf_index))
    return row


def pack_paths(
    trees: RolloutTree | Sequence[RolloutTree],
    full: bool = False,
    concat: bool = False,
    only: Sequence[int] | None = None,
    sequences: Collection[tuple[int, int]] | None = None,
) -> PackedBatch:
    """Path-by-path reference: one causal sequence per leaf (trees in order, leaves ascending).

    full=False: loss on the turns the sequence owns (TreeOPSD, §2.4); full=True: on every turn of the path
    (TreePO/GRPO/GSPO), `owned` still marks the owner copy.
    concat=False: right-padded rows, plain causal attention, default positions (the reference);
    concat=True: the sequences back to back in one row as causal blocks ("varlen", no padding) for
    `tree_attention`: the same attention kernel as the tree-packed forward, only the prefixes repeat.
    `only`: pack just these trees (indices into `trees`, which tree/leaf fields keep referring to);
    `sequences`: just these (tree, leaf node) sequences of them (a token-budget micro-batch of paths).
    """
    trees = [trees] if isinstance(trees, RolloutTree) else list(trees)
    used = list(range(len(trees))) if only is None else list(only)
    turns, leaves = _offsets(trees, used)
    rows, col = [], 0
    for k in used:
        tree = trees[k]
        for j, leaf in enumerate(int(x) for x in tree.leaves):
            if sequences is not None and (k, leaf) not in sequences:
                continue
            for run in tree.context_runs(leaf):  # one row per context the path crosses (restarts)
                row = _path_row(tree, run, leaf, turns[k], leaves[k] + j, full, col if concat else 0)
                rows.append(row)
                col += sum(len(x) for x in row.ids)
    if concat:
        return _collate([_merge(rows)], trees, "tree", used)
    return _collate(rows, trees, "causal", used)


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
