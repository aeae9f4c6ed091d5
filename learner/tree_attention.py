"""Tree attention without a dense T×T mask: block-sparse SDPA over query chunks (split from forward.py).

A dense additive mask makes attention cost T² for a packed tree although each token only sees its own
root-to-token path; on CPU that term dominated the tree-packed step (80 % of it for the tiny model), making it
slower than path-by-path. The plan below computes exactly the same attention, chunk by chunk, straight from
the packed batch's node segments (`PackedBatch.segments`: start, end, parent segment), never from a mask:

    runs    maximal chains of segments that follow one another in the row (each the parent of the next)
    chunks  runs cut into ≤ `chunk` query tokens; a chunk's keys are its run's ancestor segments, whole,
            and the run up to the chunk's last query (the last query sees every key an earlier one does)
    groups  chunks sorted by key count and batched while the padding stays below `waste`; one SDPA call each

so the work is Σ_chunks chunk · |path|, the plan's memory Σ_chunks chunk · |path| bytes (not T²), and no
chunk spans two branches. The result equals the
dense-mask forward to float rounding (tests/unit/test_packing.py). Registered as the transformers attention
implementation `TREE_ATTENTION`; `forward.token_logprobs` switches the model to it only for the duration of
a tree-packed forward and passes the plan through the model's attention kwargs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

TREE_ATTENTION = "treeopsd_tree"


@dataclass(eq=False)
class TreePlan:
    """Query chunks of all groups laid out one after another (padded), their key lists likewise.

    Group g covers query slots [q0, q0 + G·C) of `q_perm` and key slots [k0, k0 + G·K) of `k_perm`;
    `inverse[t]` is the slot of token t (a slot past the end, i.e. a zero row, for padding tokens).
    """

    shapes: list[tuple[int, int, int, int, int]]  # (G, C, K, q0, k0) per group
    allowed: list[torch.Tensor]  # [G, C, K] bool per group; padding query rows see key 0 only
    q_perm: torch.Tensor  # [Σ G·C] flat token index of each query slot
    k_perm: torch.Tensor  # [Σ G·K] flat token index of each key slot
    inverse: torch.Tensor  # [B·T] slot of each token
    entries: int  # attention scores computed per head (Σ G·C·K), for diagnostics
    _masks: dict = field(default_factory=dict)  # per dtype/device: masks and index copies

    def masks(self, dtype: torch.dtype, device: torch.device, rep: int) -> list[torch.Tensor]:
        """Additive [G, 1, rep·C, K] masks; the rep query heads sharing a KV head are folded into rows."""
        key = (dtype, str(device), rep)
        if key not in self._masks:
            lo = torch.finfo(dtype).min
            self._masks[key] = [
                torch.where(a, 0.0, lo).to(dtype=dtype, device=device).repeat(1, rep, 1)[:, None]
                for a in self.allowed
            ]
        return self._masks[key]

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_perm, k_perm, inverse) on `device`, copied once per plan (not once per layer)."""
        key = ("idx", str(device))
        if key not in self._masks:
            self._masks[key] = tuple(t.to(device) for t in (self.q_perm, self.k_perm, self.inverse))
        return self._masks[key]


def _runs(segments: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, int, int, list[int]]]:
    """(row, start, end, ancestor segment ids of the run's first segment) per run."""
    runs: list[tuple[int, int, int, list[int]]] = []
    for k, (row, start, end, parent) in enumerate(segments):
        if runs and parent == k - 1 and runs[-1][0] == row and runs[-1][2] == start:
            r = runs[-1]
            runs[-1] = (row, r[1], end, r[3])
            continue
        ancestors, a = [], parent
        while a >= 0:
            ancestors.append(a)
            a = segments[a][3]
        runs.append((row, start, end, ancestors[::-1]))
    return runs


def _chunks(
    segments: Sequence[tuple[int, int, int, int]], row_len: int, chunk: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(query indices, key indices, mask block) of each chunk, flat over the [B, row_len] batch."""
    for row, r0, r1, ancestors in _runs(segments):
        base = row * row_len
        above = [np.arange(segments[a][1], segments[a][2]) for a in ancestors]
        above_keys = np.concatenate([np.zeros(0, np.int64), *above])
        for c0 in range(r0, r1, chunk):
            c1 = min(c0 + chunk, r1)
            own = np.arange(r0, c1)
            mask = np.ones((c1 - c0, len(above_keys) + len(own)), bool)
            mask[:, len(above_keys) :] = own[None, :] <= np.arange(c0, c1)[:, None]  # causal in the run
            yield base + np.arange(c0, c1), base + np.concatenate([above_keys, own]), mask


def _group(batch: list, q0: int, k0: int) -> tuple[tuple[int, ...], np.ndarray, np.ndarray, np.ndarray, list]:
    g, c, k = len(batch), max(len(q) for q, _, _ in batch), max(len(k) for _, k, _ in batch)
    q_idx, k_idx = np.zeros((g, c), np.int64), np.zeros((g, k), np.int64)
    allowed = np.zeros((g, c, k), bool)
    allowed[:, :, 0] = True
    slots = []
    for b, (qs, ks, m) in enumerate(batch):
        q_idx[b], k_idx[b] = qs[0], ks[0]
        q_idx[b, : len(qs)], k_idx[b, : len(ks)] = qs, ks
        allowed[b, : len(qs), : len(ks)] = m
        slots.append((qs, q0 + b * c + np.arange(len(qs))))
    return (g, c, k, q0, k0), q_idx.ravel(), k_idx.ravel(), allowed, slots


def build_plan(
    segments: Sequence[tuple[int, int, int, int]],
    num_tokens: int,
    row_len: int,
    chunk: int = 32,
    waste: float = 1.25,
) -> TreePlan:
    """Plan for `PackedBatch.segments` (row, start, end, parent) of a [B, row_len] batch of B·row_len
    tokens."""
    pieces = list(_chunks(segments, row_len, chunk))
    pieces.sort(key=lambda c: -len(c[1]))
    shapes, allowed, q_perm, k_perm, slots = [], [], [], [], []
    q0 = k0 = i = 0
    while i < len(pieces):
        j = i
        while j < len(pieces) and len(pieces[j][1]) * waste >= len(pieces[i][1]):
            j += 1
        shape, q_idx, k_idx, a, sl = _group(pieces[i:j], q0, k0)
        shapes.append(shape)
        allowed.append(torch.from_numpy(a))
        q_perm.append(q_idx)
        k_perm.append(k_idx)
        slots += sl
        q0, k0, i = q0 + len(q_idx), k0 + len(k_idx), j
    inverse = np.full(num_tokens, q0, np.int64)  # slot q0 = the zero row appended after the last group
    for toks, where in slots:
        inverse[toks] = where
    cat = lambda xs: torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *xs]))  # noqa: E731
    entries = sum(g * c * k for g, c, k, _, _ in shapes)
    return TreePlan(shapes, allowed, cat(q_perm), cat(k_perm), torch.from_numpy(inverse), entries)


def tree_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tree_plan: TreePlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query [B, H, T, D], key/value [B, Hkv, T, D] → [B, T, H, Dv].

    One gather for all query slots and one for all key/value slots per layer (their backward is one
    scatter-add each); GQA folds the rep query heads of a KV head into the query rows instead of
    repeating K/V.
    """
    if tree_plan is None:
        raise ValueError(f"attn_implementation {TREE_ATTENTION!r} needs the tree_plan kwarg")
    b, h, t, d = query.shape
    hkv, dv = key.shape[1], value.shape[-1]
    rep, dev = h // hkv, query.device
    q_perm, k_perm, inverse = tree_plan.indices(dev)
    q = query.transpose(1, 2).reshape(b * t, hkv, rep, d)[q_perm]
    kv = torch.cat([key, value], dim=-1).transpose(1, 2).reshape(b * t, hkv, d + dv)[k_perm]
    shapes = tree_plan.shapes
    # split (not slicing): a slice's backward zero-fills a buffer of the whole gathered tensor per group
    q_parts = q.split([g * c for g, c, _, _, _ in shapes])
    kv_parts = kv.split([g * k for g, _, k, _, _ in shapes])
    outs = []
    for (g, c, k, _, _), qs, kvs, mask in zip(
        shapes, q_parts, kv_parts, tree_plan.masks(query.dtype, dev, rep), strict=True
    ):
        qg = qs.view(g, c, hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(g, hkv, rep * c, d)
        kg, vg = kvs.view(g, k, hkv, d + dv).transpose(1, 2).split([d, dv], dim=-1)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, dropout_p=dropout, scale=scaling)
        outs.append(o.view(g, hkv, rep, c, dv).permute(0, 3, 1, 2, 4).reshape(g * c, h, dv))
    outs.append(query.new_zeros(1, h, dv))  # the row padding tokens read
    out = torch.cat(outs).index_select(0, inverse)
    return out.view(b, t, h, dv), None


AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)


@contextmanager
def use_attention(model: nn.Module, name: str) -> Iterator[None]:
    """Temporarily switch the model's attention implementation (the config object is shared by all layers;
    not thread-safe: one forward at a time per model)."""
    config = model.config
    old = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = old
