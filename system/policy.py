"""The policy-backend interfaces the sampler talks through (vLLM on GPU/CPU, HF transformers for tiny models):
`PolicyBackend` (batches of turns) and `TurnServer` (one turn per call, many in flight: the asynchronous
agent loop's view; vLLM's backend is one natively, any PolicyBackend through actors/turn_server.py).

Token-in/token-out: a request carries the full context as token ids and gets back the sampled token ids and
their log-probs under the sampling distribution `SamplingConfig.of(cfg.sampler)` sets (the log-probs are the
behavior policy's). Nothing here re-tokenizes text. New weights are loaded in place between turns
(`load_weights`; `apply_weights` on a TurnServer), only by actors/weight_gate.py:load_version.

Usage::

    [res] = backend.sample([SampleRequest(context=ids, max_new_tokens=64, stop_token_ids=(eos,))])
    res.token_ids, res.logprobs, res.finish_reason, backend.version
"""

from __future__ import annotations

import hashlib
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from configs.schema import SamplerConfig


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    seed: int | None = None

    @classmethod
    def of(cls, sampler: SamplerConfig, greedy: bool = False, seed: int | None = None) -> SamplingConfig:
        """The distribution `sampler.*` configures (greedy: temperature 0, the model's argmax); the samplers
        draw from it and the learner scores under it (system/sampling.py)."""
        if greedy:
            return cls(temperature=0.0, seed=seed)
        return cls(sampler.temperature, sampler.top_p, sampler.top_k or -1, seed)


def mix_seed(base: int, n: int) -> int:
    """An independent, reproducible seed for request n of a backend seeded with `base` (a hash, so nearby
    (base, n) pairs don't correlate): each request's draws then depend only on it, not on its batch."""
    digest = hashlib.blake2b(f"{base}:{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class SampleRequest:
    """One turn to sample. `cache_key`/`parent_key` let a backend reuse the KV of an earlier context.

    `parent_key` names an earlier request's `cache_key`; the backend must check that the stored ids are a
    prefix of `context` (or crop to the common prefix) before reusing anything. Backends with automatic
    prefix caching (vLLM) may ignore both keys.

    `stop_strings`: text stop sequences for stops that are no single token (`</tool_call>` in a vocabulary
    without that token, Search-R1's `</search>`): the turn also ends at the first sampled token whose
    decoded text completes one of them; that token is kept (finish "stop") and nothing is cut off it.
    """

    context: Sequence[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    cache_key: str | None = None
    parent_key: str | None = None
    stop_strings: tuple[str, ...] = ()
    # The request's own draws (None: the backend's counter, mix_seed(seed, n)): set by the agent loop from
    # the episode and turn, so a turn samples the same ids whatever else runs beside it or before it
    seed: int | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution
    finish_reason: str  # "stop" (a stop token was sampled; it is included) | "length"
    cached_prefix_tokens: int = 0  # context tokens served from a cache (prefix reuse), for metrics
    info: dict[str, Any] = field(default_factory=dict)


class PolicyBackend(Protocol):
    """Samples turns and scores token ids; takes new weights in place."""

    version: int

    def sample(self, requests: Sequence[SampleRequest]) -> list[SampleResult]: ...

    def score(self, context: Sequence[int], start: int) -> list[float]:
        """Log-probs of context[start:] given their prefixes (for token-in/token-out checks)."""
        ...

    def load_weights(self, named_tensors: Mapping[str, Any], version: int) -> None: ...

    def evict(self, *keys: str) -> None:
        """Frees what is kept for finished episodes (cache keys); a no-op where nothing is (vLLM's prefix
        cache is content-addressed). The lockstep loop calls it after a round, `BatchedTurns.release` after
        a tree."""
        ...

    def close(self) -> None: ...


T = TypeVar("T")


@runtime_checkable  # `as_turn_server`: a backend that is a TurnServer itself (vLLM) serves its own turns
class TurnServer(Protocol):
    """A backend as the asynchronous agent loop sees it (actors/async_loop.py): one turn per call, many
    calls in flight. vLLM's backend is one natively (its async engine); any PolicyBackend becomes one
    through `actors/turn_server.py:BatchedTurns`, which gathers the pending turns into `sample` batches."""

    version: int

    async def generate_turn(self, request: SampleRequest) -> SampleResult: ...

    async def apply_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Loads a version in place; called only while no turn is being generated."""
        ...

    async def prepare_weights(self, named_tensors: Mapping[str, Any]) -> Any:
        """Checks and stages a version while turns still run (vLLM: for its workers); what it returns goes
        to `apply_weights`. The weight gate calls it before it pauses the episodes, so the pause is the load
        alone; a server with nothing to stage returns the tensors as they are."""
        ...

    async def release(self, *keys: str) -> None:
        """Frees what is kept for finished episodes (cache keys); a no-op where nothing is."""
        ...

    def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine that calls this server (the asynchronous agent loop, a weight load) to its end
        on the event loop the server needs: vLLM's engine loop; `asyncio.run` for BatchedTurns."""
        ...
