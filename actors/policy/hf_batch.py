"""Lock-step decoding of many requests for the HF backend (CPU, small models): one forward per step for all
rows, the prefill included, with each row's own KV cache reused and stored back per episode.

Layout of the batch cache, per row i (P_i tokens reused from its parent's cache, S_i tokens to prefill):

    [ pad (W − P_i) | its cache (P_i) | pad (S − S_i) | its suffix (S_i) | one token per decode step ... ]

W = max P_i and S = max S_i. The 2D attention mask is 0 on the pads, so a row attends to its own tokens
only; `position_ids` are each row's own positions (the cache's keys carry theirs already), so a row's logits
are the ones it would get alone, up to float rounding of the batched matmuls. Afterwards each row's cache is
cut back out of the batch (its three real spans, copied) and stored for its episode.

The pads of the suffix span cost a full forward each: a call that mixes fresh 70-token prompts with
400-token observations (the real demo's first and second turns) computed half its prefill on pads. So the
rows are prefilled in groups of similar suffix length (`suffix_groups`: padded tokens at most `PAD_SLACK`
times the real ones), each group as above; with more than one group, every row's cache is cut out of its
group and the rows are stacked once more for the decode steps, left-padded to the longest:

    [ pad (L − L_i) | its cache and suffix (L_i = P_i + S_i) | one token per decode step ... ]

The batch cache's layers are `RoomyLayer`s: each decode step writes its token's K/V into spare room at the
end instead of concatenating (a DynamicLayer copies the whole cache on every step: 30 % of a decode step of
8 rows × 400 cached tokens, measured with SmolLM2-135M on one CPU thread).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@dataclass
class Lockstep:
    cache: DynamicCache  # the batch cache
    mask: torch.Tensor  # [rows, cache length] long, 1 on real tokens
    positions: list[int]  # each row's next position (its real length so far)
    spans: list[list[tuple[int, int]]]  # each row's real [start, stop) spans in the batch cache
    width: int  # where the decode steps begin (W + S)


class RoomyLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of the first n positions of larger buffers: `update`
    writes the new positions in place and grows the buffers (by half again, at least `ROOM` positions)
    only when they are full. Views handed out earlier keep their values: writes go past their end."""

    ROOM = 256

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        super().__init__()
        self._k = self._v = torch.empty(0, 0, 0, 0)  # the buffers; sized on the first keys
        if keys is not None and values is not None:
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            self._grow(keys, values, keys.shape[-2])

    def _grow(self, keys: torch.Tensor, values: torch.Tensor, need: int) -> None:
        """New buffers holding `keys`/`values` with room for `need` positions and more."""
        size = need + max(self.ROOM, need // 2)
        self._k = keys.new_empty((*keys.shape[:2], size, keys.shape[3]))
        self._v = values.new_empty((*values.shape[:2], size, values.shape[3]))
        n = keys.shape[-2]
        self._k[..., :n, :].copy_(keys)
        self._v[..., :n, :].copy_(values)
        self.keys, self.values = self._k[..., :n, :], self._v[..., :n, :]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:  # a row with nothing cached: empty buffers of the right shape first
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            self._grow(key_states[..., :0, :], value_states[..., :0, :], key_states.shape[-2])
        n = self.keys.shape[-2]
        end = n + key_states.shape[-2]
        if end > self._k.shape[-2]:
            self._grow(self.keys, self.values, end)
        self._k[..., n:end, :].copy_(key_states)
        self._v[..., n:end, :].copy_(value_states)
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values


def roomy(layers: list[tuple[torch.Tensor, torch.Tensor]], config: object) -> DynamicCache:
    """A batch cache over `layers` ((keys, values) per layer; none: lazily on the first forward) whose
    decode steps write in place (`RoomyLayer`)."""
    cache = DynamicCache(config=config)
    if layers:
        cache.layers = [RoomyLayer(k, v) for k, v in layers]
    else:
        cache.layers = [RoomyLayer() for _ in cache.layers]
    return cache


def _left_pad(t: torch.Tensor | None, like: torch.Tensor, width: int) -> torch.Tensor:
    """[1, heads, n, dim] → [1, heads, width, dim] with zeros in front (a row without a cache: all zeros)."""
    if t is None:
        return like.new_zeros((1, like.shape[1], width, like.shape[3]))
    return torch.nn.functional.pad(t, (0, 0, width - t.shape[-2], 0))


def _stack(caches: list[DynamicCache], width: int, config: object) -> DynamicCache:
    if width == 0:
        return roomy([], config)
    layers = []
    for parts in zip(*(list(c) for c in caches), strict=True):
        like = next(k for k, *_ in parts if k is not None)
        keys = torch.cat([_left_pad(k, like, width) for k, *_ in parts])
        values = torch.cat([_left_pad(v, like, width) for _, v, *_ in parts])
        layers.append((keys, values))
    return roomy(layers, config)


PAD_SLACK = 1.25  # a prefill group's padded suffix tokens over its real ones, at most


def suffix_groups(lengths: list[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """Row indices grouped by suffix length (shortest first): a row joins the current group while the
    group's padded tokens, rows × the longest, stay within `slack` × its real tokens."""
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = lengths[i]
        if current and (len(current) + 1) * n > slack * (real + n):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += n
    return [*groups, current] if current else groups


def prefill(
    model, caches: list[DynamicCache], suffixes: list[list[int]], device
) -> tuple[Lockstep, torch.Tensor]:
    """Feeds every row's suffix after its cache, in groups of similar length (module docstring); returns
    the lock-step state and the [rows, V] float32 logits of each row's last token."""
    groups = suffix_groups([len(x) for x in suffixes])
    if len(groups) == 1:
        return _prefill_group(model, caches, suffixes, device)
    config = model.config
    rows: list[DynamicCache | None] = [None] * len(caches)
    logits: list[torch.Tensor | None] = [None] * len(caches)
    for group in groups:
        state, out = _prefill_group(model, [caches[i] for i in group], [suffixes[i] for i in group], device)
        for r, i in enumerate(group):
            rows[i], logits[i] = row_cache(state, r, 0, config), out[r]
        del state  # its batch cache: the rows hold copies
    lengths = [c.get_seq_length() for c in rows]  # type: ignore[union-attr]
    width = max(lengths)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    spans = [[(width - n, width)] for n in lengths]
    state = Lockstep(_stack(rows, width, config), mask, lengths, spans, width)  # type: ignore[arg-type]
    return state, torch.stack(logits)  # type: ignore[arg-type]


def _prefill_group(
    model, caches: list[DynamicCache], suffixes: list[list[int]], device
) -> tuple[Lockstep, torch.Tensor]:
    """Stacks the rows' caches and feeds every row's suffix in one forward."""
    config = model.config
    reused = [c.get_seq_length() for c in caches]
    w, s = max(reused), max(len(x) for x in suffixes)
    cache = _stack(caches, w, config)
    ids = torch.zeros(len(caches), s, dtype=torch.long)
    pos = torch.zeros(len(caches), s, dtype=torch.long)
    mask = torch.zeros(len(caches), w + s, dtype=torch.long)
    spans = []
    for i, (p, suffix) in enumerate(zip(reused, suffixes, strict=True)):
        n = len(suffix)
        ids[i, s - n :] = torch.tensor(suffix)
        pos[i, s - n :] = torch.arange(p, p + n)
        mask[i, w - p : w] = 1
        mask[i, w + s - n :] = 1
        spans.append([(w - p, w), (w + s - n, w + s)])
    out = _forward(model, ids, cache, mask, pos, device)
    state = Lockstep(cache, mask, [p + len(x) for p, x in zip(reused, suffixes, strict=True)], spans, w + s)
    return state, out.logits[:, -1].float().cpu()


def step(model, state: Lockstep, feed: torch.Tensor, device) -> torch.Tensor:
    """Feeds one token per row ([rows, 1]); returns the [rows, V] logits of the next token."""
    state.mask = torch.cat([state.mask, torch.ones(len(state.positions), 1, dtype=torch.long)], dim=1)
    pos = torch.tensor([[p] for p in state.positions], dtype=torch.long)
    out = _forward(model, feed, state.cache, state.mask, pos, device)
    state.positions = [p + 1 for p in state.positions]
    return out.logits[:, -1].float().cpu()


def take_rows(state: Lockstep, rows: list[int], config: object) -> Lockstep:
    """The lock-step state of `rows` (indices into the batch, repeats allowed): a row's twin gets a copy
    of its cache, mask and positions; a row left out is gone (cut its cache out first: `row_cache`)."""
    index = torch.tensor(rows, dtype=torch.long)
    layers = [
        (k.index_select(0, index.to(k.device)), v.index_select(0, index.to(k.device)))
        for k, v, *_ in state.cache
    ]
    cache = roomy(layers, config)
    return Lockstep(
        cache,
        state.mask.index_select(0, index),
        [state.positions[r] for r in rows],
        [list(state.spans[r]) for r in rows],
        state.width,
    )


def row_cache(state: Lockstep, row: int, fed: int, config: object) -> DynamicCache:
    """Row `row`'s cache (copied out of the batch): its real spans and its first `fed` decode steps."""
    spans = [*state.spans[row], (state.width, state.width + fed)]
    idx = torch.cat([torch.arange(a, b) for a, b in spans])
    pick = [(k[row : row + 1], v[row : row + 1]) for k, v, *_ in state.cache]
    layers = [(k.index_select(2, idx.to(k.device)), v.index_select(2, idx.to(k.device))) for k, v in pick]
    return DynamicCache(layers, config=config)


def _forward(model, ids, cache, mask, pos, device):  # type: ignore[no-untyped-def]
    return model(
        input_ids=ids.to(device),
        past_key_values=cache,
        use_cache=True,
        attention_mask=mask.to(device),
        position_ids=pos.to(device),
        logits_to_keep=1,
    )
