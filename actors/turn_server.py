"""Any PolicyBackend as a TurnServer (system/policy.py) for the asynchronous agent loop: the turns that are
pending when the backend is free go to it as one `sample` call.

    server = as_turn_server(backend)            # vLLM's backend is one already; HF gets BatchedTurns
    result = await server.generate_turn(req)    # from many episode coroutines at once

The backend runs in one worker thread, so the event loop keeps handing out tool calls (and gathering the
next batch) while a batch decodes; every call into the backend (sample, weights, cache eviction) goes
through that thread, one at a time, so the backend itself needs no locks. A batch takes whatever is pending
when the previous one returns: under load, the episodes that finished their tool calls meanwhile. For the
HF backend that is its lock-step batch decoding (actors/policy/hf_batch.py), with a request's draws seeded
by the request itself (`SampleRequest.seed`), so its ids do not depend on the batch it lands in (its
log-probs only up to the float rounding of the batched matmuls).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from system.policy import PolicyBackend, SampleRequest, SampleResult, TurnServer

T = TypeVar("T")


class BatchedTurns:
    """TurnServer over a synchronous PolicyBackend; see the module docstring."""

    def __init__(self, backend: PolicyBackend) -> None:
        self.backend = backend
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="policy")
        self._pending: list[tuple[SampleRequest, asyncio.Future[SampleResult]]] = []
        self._pump: asyncio.Task[None] | None = None
        self.batches = 0  # sample calls made (a batch per call)
        self.requests = 0

    @property
    def version(self) -> int:
        return int(self.backend.version)

    async def generate_turn(self, request: SampleRequest) -> SampleResult:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[SampleResult] = loop.create_future()
        self._pending.append((request, fut))
        if self._pump is None or self._pump.done():
            self._pump = loop.create_task(self._serve())
        return await fut

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending, []
            self.batches, self.requests = self.batches + 1, self.requests + len(batch)
            try:
                results = await loop.run_in_executor(self._pool, self.backend.sample, [r for r, _ in batch])
            except Exception as exc:  # every turn of the batch fails with the backend's error
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)

    async def prepare_weights(self, named_tensors: Any) -> Any:
        """Nothing to stage ahead: `load_weights` copies the tensors in place itself."""
        return named_tensors

    async def apply_weights(self, named_tensors: Any, version: int) -> None:
        load = functools.partial(self.backend.load_weights, named_tensors, version=version)
        await asyncio.get_running_loop().run_in_executor(self._pool, load)

    async def release(self, *keys: str) -> None:
        if keys:  # e.g. the HF backend's per-episode KV caches
            await asyncio.get_running_loop().run_in_executor(self._pool, self.backend.evict, *keys)

    def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """A fresh event loop per call: the backend itself runs in the worker thread, not on any loop."""
        return asyncio.run(coro)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def as_turn_server(backend: PolicyBackend | TurnServer) -> TurnServer:
    """The backend itself when it is a TurnServer (vLLM: its own async engine), else BatchedTurns over it."""
    if isinstance(backend, TurnServer):
        return backend
    return BatchedTurns(backend)
