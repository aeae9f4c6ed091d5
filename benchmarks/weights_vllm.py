"""`bench weights`'s vLLM figures (benchmarks/bench_weights.py runs them in the same run): one vLLM engine
(a Qwen2-shaped model saved here with layers as wide as Qwen3-0.6B's, its bfloat16 state dict at least 256 MB;
`--quick`: 32 MB) and one bf16 payload with the checkpoint's names.

- `inplace_s_vllm`: `VLLMBackend.load_weights` of a version as the sampler receives it (published once and
  polled by a `WeightSubscriber` here: views of the publisher's sealed memfd, held open by the subscriber)
  over the in-place path: each worker maps that memfd and feeds the model's own weight loader over
  `collective_rpc`; nothing is copied in the sampler;
- `file_s_vllm`: the same received version over the old path: a safetensors file written to /dev/shm, each
  worker reads and loads it (`weight_transfer="file"`), the file removed;
- `inplace_over_file` = file_s_vllm / inplace_s_vllm (goal >= 1.5);
- `inplace_staged_s_vllm`: the in-place path for tensors of this process (not received through a memfd:
  copied into the sampler's own memfd first, actors/policy/vllm_weights.py), for reference;
- `apply_s_vllm`: from `WeightPublisher.publish` until the version is loaded into the engine: a
  `WeightSubscriber` in this process (same host: shared memory) polls it and hands it to `load_weights`;
  `apply_received_s_vllm` is its first part (publish until the subscriber holds the version).

All paths end with the prefix-cache reset a load needs. The load paths take turns round by round and
the best of `reps` rounds after a warm-up counts (the machine is shared). The engine runs in bfloat16, the
payload's dtype, as a sampler's engine does when it samples in the training dtype (a float32 engine would add
vLLM's cast of every tensor to both paths alike); `enforce_eager` skips torch.compile, which a weight load
never uses.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.workloads import qwen2_config_for_bytes

# Layers as wide as Qwen3-0.6B's (hidden 1024, FFN 3072, 16 heads, 8 KV heads): vLLM's reload costs some
# Python per layer, so narrower layers of the same bytes would weigh that fixed part, not the bytes moved.
HIDDEN, FFN, HEADS, KV_HEADS = 1024, 3072, 16, 8


def _config(target_bytes: int) -> dict[str, Any]:
    """Qwen2 config kwargs whose bfloat16 state dict is about `target_bytes`."""
    shape = (HIDDEN, FFN, HEADS, KV_HEADS)
    return {**qwen2_config_for_bytes(target_bytes, 2, 8192, shape), "max_position_embeddings": 512}


def _checkpoint(folder: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Saves a bf16 model to `folder`; returns its state dict (the payload: bf16, checkpoint names)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(torch.bfloat16)
    model.save_pretrained(folder)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _load_once(backend: Any, payload: dict[str, Any], version: int, transfer: str) -> float:
    backend.weight_transfer = transfer
    t0 = time.perf_counter()
    backend.load_weights(payload, version=version)
    return time.perf_counter() - t0


def _poll_version(sub: Any, version: int) -> Any:
    """The subscriber's next version, which must be `version` (published just before), within 120 s."""
    got = sub.poll(timeout_ms=120_000)  # returns as soon as the version is in
    if got is None or got[0] != version:
        raise TimeoutError(f"bench weights: v{version} not received in 120 s (got {got and got[0]})")
    return got[1]


def _received(payload: dict[str, Any]) -> tuple[Any, Any, Any]:
    """`payload` published once and received by a subscriber here, as a sampler receives a version: views
    of the publisher's sealed memfd, which the subscriber holds open. -> (publisher, subscriber, version)."""
    from actors.weight_subscriber import WeightSubscriber
    from learner.weight_publisher import WeightPublisher

    pub = WeightPublisher(keep=1)
    sub = WeightSubscriber(pub.endpoint)
    try:
        pub.publish(payload, 1)
        return pub, sub, _poll_version(sub, 1)
    except BaseException:
        sub.close()
        pub.close()
        raise


def _loads_side_by_side(backend: Any, payload: dict[str, Any], reps: int) -> dict[str, float]:
    """Best of `reps` rounds (after a warm-up) of each load path, taking turns: "shared" and "file" load the
    received version, "staged" the in-process tensors (copied into the sampler's own memfd first)."""
    pub, sub, received = _received(payload)
    best = {"shared": float("inf"), "file": float("inf"), "staged": float("inf")}
    try:
        if getattr(received, "memfd", None) is None:
            raise RuntimeError("bench weights: the version did not arrive through a sealed memfd")
        for version in range(1, reps + 2):
            for i, path in enumerate(best):
                tensors = payload if path == "staged" else received
                transfer = "file" if path == "file" else "shared"
                dt = _load_once(backend, tensors, 3 * version + i, transfer)
                if version > 1:  # the first round is the warm-up
                    best[path] = min(best[path], dt)
    finally:
        del received
        sub.close()
        pub.close()
    return best


def _publish_to_engine(backend: Any, payload: dict[str, Any], reps: int) -> tuple[float, float]:
    """Best of `reps` (after a warm-up) of publish → subscriber poll → load into the engine, and of its
    first part (publish until the subscriber holds the version)."""
    from actors.weight_subscriber import WeightSubscriber
    from benchmarks.workloads import wait_until
    from learner.weight_publisher import WeightPublisher

    pub = WeightPublisher(keep=1)
    sub = WeightSubscriber(pub.endpoint)
    best = received = float("inf")
    try:
        backend.weight_transfer = "shared"
        for version in range(1000, 1001 + reps):
            # steady state: training runs between publishes
            ready = lambda: pub.stats()["spare_ready"] and not pub.stats()["hashing"]  # noqa: E731
            wait_until(ready, "the publisher's spare memfd and hash")
            t0 = time.perf_counter()
            pub.publish(payload, version)
            got = _poll_version(sub, version)
            t1 = time.perf_counter()
            backend.load_weights(got, version=version)
            if version > 1000:
                best, received = min(best, time.perf_counter() - t0), min(received, t1 - t0)
            del got
    finally:
        sub.close()
        pub.close()
    return best, received


def run_vllm(quick: bool, reps: int) -> dict[str, Any]:
    from actors.policy.vllm_backend import VLLMBackend

    cfg = _config((32 if quick else 264) << 20)
    with tempfile.TemporaryDirectory(prefix="treeopsd-bench-weights-") as tmp:
        payload = _checkpoint(Path(tmp) / "model", cfg)
        nbytes = sum(t.nbytes for t in payload.values())
        t0 = time.perf_counter()
        extra = {
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "max_model_len": 256,
            "dtype": "bfloat16",
        }
        backend = VLLMBackend(str(Path(tmp) / "model"), seed=0, extra_engine_args=extra)
        start_s = time.perf_counter() - t0
        try:
            best = _loads_side_by_side(backend, payload, reps)
            apply_s, received_s = _publish_to_engine(backend, payload, reps)
        finally:
            backend.close()
    r = lambda x: round(x, 4)  # noqa: E731
    return {
        "vllm_payload_mb": r(nbytes / 2**20),
        "vllm_payload_dtype": "bfloat16",
        "vllm_engine_dtype": "bfloat16",
        "vllm_engine_start_s": round(start_s, 1),
        "inplace_s_vllm": r(best["shared"]),
        "file_s_vllm": r(best["file"]),
        "inplace_over_file": r(best["file"] / best["shared"]),
        "inplace_staged_s_vllm": r(best["staged"]),
        "apply_s_vllm": r(apply_s),
        "apply_received_s_vllm": r(received_s),
    }
