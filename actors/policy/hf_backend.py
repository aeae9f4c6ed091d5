"""HF-transformers policy backend: token-level decoding with a KV cache kept across turns (CPU, tiny models).

Implements `system.policy.PolicyBackend`. Never calls `generate` and never re-encodes text: each request
carries the full context as ids; with `parent_key` the stored `DynamicCache` of an earlier request is reused
for the longest common prefix (the whole parent when the new context extends it, a cropped copy when it
branches off earlier, a full prefill when nothing is shared), and only the new suffix is fed.

Log-probs are those of the *sampling distribution* (`system/sampling.py:sampling_logprobs`, the one the
learner scores with too): log-softmax of logits/T with tokens outside top-k/top-p removed and the rest
renormalized. At the defaults (T=1, top-p 1, top-k off) these are the model's own log-probs. Temperature 0
means greedy (argmax) and reports the model's log-probs (T=1). `score` applies the same transform, so
score(sampled ids) reproduces the sampled log-probs.

Requests in one `sample` call decode in lock step (`actors/policy/hf_batch.py`: each row prefilled into its
own cache, the caches left-padded into one batch, one forward per step for all rows), or one after another
with `batch=False`. Each request draws from its own generator, seeded from the backend's seed and the
request's number, so the draws of a request do not depend on the others in its call: the same call sequence
on the same weights gives the same ids either way (up to float rounding of the batched matmuls).

Usage::

    backend = HFBackend("/tmp/tiny", sampling=SamplingConfig(seed=0))
    [r1] = backend.sample([SampleRequest(ctx, 64, (eos,), cache_key="ep1")])
    ctx2 = ctx + r1.token_ids + obs_ids
    [r2] = backend.sample([SampleRequest(ctx2, 64, (eos,), cache_key="ep1", parent_key="ep1")])
    r2.cached_prefix_tokens  # == len(ctx) + len(r1.token_ids) - 1 (the last sampled token was never fed)
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from actors.policy import hf_batch
from actors.policy.grouped_attention import use_grouped_attention
from actors.policy.hf_lora import AdapterMerge
from actors.policy.tiny_model import load_model, set_threads
from system.lora_sync import is_adapter
from system.policy import SampleRequest, SampleResult, SamplingConfig, mix_seed
from system.sampling import sampling_logprobs


@dataclass
class _Entry:
    ids: list[int]  # the tokens whose K/V the cache holds, in order
    cache: DynamicCache


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _first_of_each(contexts: list[list[int]], reused: list[int]) -> list[int]:
    """Per row, the row that prefills its context: of the rows with equal contexts, the one with the most
    tokens already cached (the first such)."""
    best: dict[tuple[int, ...], int] = {}
    for i, context in enumerate(contexts):
        key = tuple(context)
        if key not in best or reused[i] > reused[best[key]]:
            best[key] = i
    return [best[tuple(c)] for c in contexts]


class HFBackend:
    """PolicyBackend over a local HF causal LM; the module docstring gives the caching and log-prob rules."""

    def __init__(
        self,
        model_path_or_model: str | Path | PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        threads: int = 1,
        sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 - frozen dataclass, safe as a default
        device: str = "cpu",
        max_cached_sessions: int = 512,
        dtype: torch.dtype = torch.float32,
        batch: bool = True,
    ) -> None:
        set_threads(threads)
        if isinstance(model_path_or_model, str | Path):
            model, loaded_tok = load_model(model_path_or_model, dtype=dtype, threads=threads)
            tokenizer = tokenizer or loaded_tok
        else:
            model = model_path_or_model
        self.model = model.to(device).eval()
        use_grouped_attention(self.model)  # K/V heads not copied per query head (same numbers)
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.device = torch.device(device)
        self.max_cached_sessions = max_cached_sessions
        self.version = 0
        self.batch = batch
        self._sliding = any(layer.is_sliding for layer in DynamicCache(config=self.model.config).layers)
        self._seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()))
        self._n_requests = 0
        self._caches: OrderedDict[str, _Entry] = OrderedDict()
        self._adapters = AdapterMerge()  # a LoRA learner's versions: adapters merged over a kept base

    # ---- PolicyBackend -------------------------------------------------------------------------------
    def sample(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        gens = [self._generator(r.seed) for r in requests]
        if self.batch and len(requests) > 1 and not self._sliding:
            return self._sample_batch(list(requests), gens)
        return [self._sample_one(r, g) for r, g in zip(requests, gens, strict=True)]

    def _generator(self, seed: int | None = None) -> torch.Generator:
        """Request n's own draws: seeded from (backend seed, n), whatever else shares its `sample` call, or
        from the request's own seed (`SampleRequest.seed`) when it carries one."""
        gen = torch.Generator(device="cpu").manual_seed(
            mix_seed(self._seed, self._n_requests) if seed is None else seed
        )
        self._n_requests += 1
        return gen

    @torch.inference_mode()
    def score(self, context: Sequence[int], start: int) -> list[float]:
        """Log-probs of context[start:] under the sampling distribution, by one forward pass (start >= 1)."""
        if not 1 <= start <= len(context):
            raise ValueError(f"start must be in [1, {len(context)}], got {start}")
        ids = torch.tensor([list(context)], device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0, start - 1 : -1].float().cpu()
        lps = sampling_logprobs(logits, self.sampling)
        target = torch.tensor(list(context[start:])).unsqueeze(-1)
        return lps.gather(-1, target).squeeze(-1).tolist()

    def load_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Copies tensors into the model in place (dtype cast; names and shapes must match) and drops caches.

        A subset of the parameters is allowed (the rest keep their values); an unknown name or a wrong shape
        raises ValueError before anything is copied. A LoRA adapter (system/lora_sync.py) is merged over the
        base instead (actors/policy/hf_lora.py; another base's is refused, the model left as it was).
        """
        if is_adapter(named_tensors):
            self._adapters.apply(self.model, named_tensors)
            self._caches.clear()
            self.version = version
            return
        state = self.model.state_dict()  # shares storage with the parameters and buffers
        unknown = sorted(set(named_tensors) - set(state))
        if unknown:
            raise ValueError(
                f"load_weights: unknown names {unknown[:5]} (model has e.g. {next(iter(state))})"
            )
        tensors = {name: torch.as_tensor(t) for name, t in named_tensors.items()}
        bad = [
            f"{n}: got {tuple(t.shape)}, want {tuple(state[n].shape)}"
            for n, t in tensors.items()
            if t.shape != state[n].shape
        ]
        if bad:
            raise ValueError(f"load_weights: shape mismatch {bad[:5]}")
        with torch.no_grad():
            for name, t in tensors.items():
                state[name].copy_(t.to(dtype=state[name].dtype, device=state[name].device))
        self._adapters.forget()  # these weights are the base of any later adapter
        self._caches.clear()  # K/V computed with the old weights are stale
        self.version = version

    def close(self) -> None:
        self._caches.clear()

    # ---- cache management ----------------------------------------------------------------------------
    def evict(self, *keys: str) -> None:
        """Frees the caches of finished sessions early (the LRU bound would drop them eventually)."""
        for key in keys:
            self._caches.pop(key, None)

    @property
    def cached_sessions(self) -> int:
        return len(self._caches)

    def _start_cache(
        self, req: SampleRequest, context: list[int], shared: bool = False
    ) -> tuple[DynamicCache, int]:
        """A cache holding the K/V of context[:n] and that n (0 = fresh). Never mutates a stored cache
        that someone else may branch from (`shared`: another request of the batch reads the same parent);
        at least one context token is always left to feed."""
        entry = self._caches.get(req.parent_key) if req.parent_key is not None else None
        if entry is None or any(layer.is_sliding for layer in entry.cache.layers):
            return DynamicCache(config=self.model.config), 0
        n = min(_common_prefix(entry.ids, context), len(context) - 1)
        if n <= 0:
            return DynamicCache(config=self.model.config), 0
        if req.parent_key == req.cache_key and not shared:
            # The entry is about to be replaced under the same key: extend it in place, no copy.
            del self._caches[req.parent_key]
            entry.cache.crop(n - len(entry.ids))  # negative: number of tokens to remove (0: no-op)
            return entry.cache, n
        self._caches.move_to_end(req.parent_key)
        # Slices are views; DynamicLayer.update concatenates into new tensors, so the parent stays intact.
        prefix = [(k[..., :n, :], v[..., :n, :]) for k, v, *_ in entry.cache]
        return DynamicCache(prefix, config=self.model.config), n

    def _store(self, key: str, ids: list[int], cache: DynamicCache) -> None:
        if self.max_cached_sessions <= 0:
            return
        self._caches[key] = _Entry(ids, cache)
        self._caches.move_to_end(key)
        while len(self._caches) > self.max_cached_sessions:
            self._caches.popitem(last=False)

    # ---- decoding ------------------------------------------------------------------------------------
    def _forward(self, ids: list[int], cache: DynamicCache) -> torch.Tensor:
        """Feeds `ids` after what `cache` holds; returns the fp32 logits [V] of the last position."""
        x = torch.tensor([ids], device=self.device)
        out = self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu()

    def _stops(self, req: SampleRequest, tokens: list[int]) -> bool:
        """Whether the turn ends at its last token: a stop id, or text completing one of `stop_strings`.

        Only the tail is decoded: every token decodes to at least one character (special tokens and
        partial UTF-8 bytes included), so a stop string of L characters that ends in the last token lies
        within its last L tokens, and one that ended earlier would have stopped the turn then."""
        if tokens[-1] in req.stop_token_ids:
            return True
        if not req.stop_strings:
            return False
        if self.tokenizer is None:
            raise ValueError(
                "SampleRequest.stop_strings need the backend's tokenizer (HFBackend(tokenizer=))"
            )
        width = max(len(s) for s in req.stop_strings) + 1  # + 1: a decoder may drop a leading space
        tail = self.tokenizer.decode(tokens[-width:], skip_special_tokens=False)
        return any(s in tail for s in req.stop_strings)

    def _pick(self, logits: torch.Tensor, generator: torch.Generator) -> tuple[int, float]:
        return self._draw(sampling_logprobs(logits, self.sampling), generator)

    def _draw(self, lps: torch.Tensor, generator: torch.Generator) -> tuple[int, float]:
        """One token from the [V] log-probs of the sampling distribution (argmax when greedy)."""
        if self.sampling.temperature <= 0:
            tok = int(torch.argmax(lps))
        else:
            # Inverse CDF with one uniform per token: explicit, so the draw sequence is easy to reason about.
            cdf = lps.double().exp().cumsum(0)
            u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
            tok = min(int(torch.searchsorted(cdf, u, right=True)), lps.shape[0] - 1)
            while not math.isfinite(float(lps[tok])):  # float edge at the top of the CDF: step back
                tok -= 1
        return tok, float(lps[tok])

    @torch.inference_mode()
    def _sample_one(self, req: SampleRequest, generator: torch.Generator) -> SampleResult:
        context = [int(t) for t in req.context]
        if not context:
            raise ValueError("SampleRequest.context must hold at least one token")
        cache, reused = self._start_cache(req, context)
        logits = self._forward(context[reused:], cache)
        tokens: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        for step in range(req.max_new_tokens):
            tok, lp = self._pick(logits, generator)
            tokens.append(tok)
            logprobs.append(lp)
            if self._stops(req, tokens):
                finish = "stop"
                break
            if step + 1 < req.max_new_tokens:  # the last token's K/V is computed when the next turn feeds it
                logits = self._forward([tok], cache)
        if req.cache_key is not None:
            seq = context + tokens
            self._store(req.cache_key, seq[: cache.get_seq_length()], cache)
        info = {"version": self.version, "prefill_tokens": len(context) - reused}
        return SampleResult(tokens, logprobs, finish, cached_prefix_tokens=reused, info=info)

    @torch.inference_mode()
    def _sample_batch(self, reqs: list[SampleRequest], gens: list[torch.Generator]) -> list[SampleResult]:
        """All requests in lock step, the prefill too (actors/policy/hf_batch.py); the same results as one
        at a time. Requests with the same context (a question's samples, a tree's trunks after the same
        call) are prefilled once: the twins copy the first one's cache and logits, then draw on their own."""
        contexts, caches, reused = [], [], []
        parents = Counter(r.parent_key for r in reqs if r.parent_key is not None)
        for req in reqs:
            context = [int(t) for t in req.context]
            if not context:
                raise ValueError("SampleRequest.context must hold at least one token")
            cache, n = self._start_cache(req, context, shared=parents[req.parent_key] > 1)
            contexts.append(context)
            caches.append(cache)
            reused.append(n)
        twin = _first_of_each(contexts, reused)  # row -> the row that prefills its context
        unique = sorted(set(twin))
        suffixes = [contexts[i][reused[i] :] for i in unique]
        state, logits = hf_batch.prefill(self.model, [caches[i] for i in unique], suffixes, self.device)
        if len(unique) < len(reqs):
            at = {row: j for j, row in enumerate(unique)}
            order = [at[twin[i]] for i in range(len(reqs))]  # each request's prefilled row
            state, logits = hf_batch.take_rows(state, order, self.model.config), logits[order]
        tokens, lps, row_caches = self._decode_lockstep(reqs, gens, logits, state)
        out = []
        for i, req in enumerate(reqs):
            fed = max(len(tokens[i]) - 1, 0)  # the last sampled token is fed by the next turn
            if req.cache_key is not None:
                ids = (contexts[i] + tokens[i])[: len(contexts[i]) + fed]
                self._store(req.cache_key, ids, row_caches[i])  # type: ignore[arg-type]
            served = reused[i] if twin[i] == i else len(contexts[i]) - 1  # a twin's K/V came from its twin
            info = {"version": self.version, "prefill_tokens": len(contexts[i]) - served}
            finish = "stop" if bool(tokens[i]) and self._stops(req, tokens[i]) else "length"
            out.append(SampleResult(tokens[i], lps[i], finish, cached_prefix_tokens=served, info=info))
        return out

    def _decode_lockstep(self, reqs, gens, logits, state) -> tuple[list, list, list]:
        """Picks a token for every live row, then feeds them all in one forward; a row ends at a stop token
        or its max_new_tokens. Ended rows stay in the batch (their steps computed and discarded) until a
        quarter of it has ended: then their caches are cut out and the batch shrinks (`take_rows`). Returns
        each row's tokens, log-probs and cache (its context and its fed tokens)."""
        config = self.model.config
        tokens: list[list[int]] = [[] for _ in reqs]
        lps: list[list[float]] = [[] for _ in reqs]
        caches: list[DynamicCache | None] = [None] * len(reqs)
        live = [r.max_new_tokens > 0 for r in reqs]
        rows = list(range(len(reqs)))  # the request of each batch row
        while any(live[i] for i in rows):
            feed = torch.zeros(len(rows), 1, dtype=torch.long)
            dist = sampling_logprobs(logits, self.sampling)  # every row's distribution in one pass
            for b, i in enumerate(rows):
                if not live[i]:
                    continue
                tok, lp = self._draw(dist[b], gens[i])
                tokens[i].append(tok)
                lps[i].append(lp)
                live[i] = not self._stops(reqs[i], tokens[i]) and len(tokens[i]) < reqs[i].max_new_tokens
                feed[b, 0] = tok
            keep = [b for b, i in enumerate(rows) if live[i]]
            if not keep:
                break
            if len(rows) - len(keep) >= max(2, len(rows) // 4):
                for b, i in enumerate(rows):
                    if not live[i] and reqs[i].cache_key is not None:
                        caches[i] = hf_batch.row_cache(state, b, max(len(tokens[i]) - 1, 0), config)
                state, feed = hf_batch.take_rows(state, keep, config), feed[keep]
                rows = [rows[b] for b in keep]
            logits = hf_batch.step(self.model, state, feed, self.device)
        for b, i in enumerate(rows):
            if reqs[i].cache_key is not None:
                caches[i] = hf_batch.row_cache(state, b, max(len(tokens[i]) - 1, 0), config)
        return tokens, lps, caches
