"""Weight broadcast: ours against a bare pyzmq send of the same bytes; fan-out to 4 against 1; apply time.

    treeopsd bench weights --json            # 256 MiB of float32 weights (a Qwen2-shaped state dict)
    treeopsd bench weights --json --quick    # 32 MiB

Every subscriber runs in its own spawned process. A timing runs from just before `publish` (or the bare
send) until every subscriber has acknowledged holding a complete, verified copy (or, for the bare send, the
received frames); each figure is the best of `reps` runs after one warm-up, with a pause between runs that
lets the publisher pre-allocate its next shared-memory file, as training between publishes would.

Keys: payload_mb; raw_zmq_s_1 (PUSH/PULL, send_multipart of the tensors' buffers with copy=False, to one
process that takes the frames and checks nothing); broadcast_s_1 / broadcast_s_4 (ours, default transport:
shared memory on one host); broadcast_over_raw_zmq (throughput ratio ours/raw, goal >= 0.8);
fanout4_over_fanout1 (goal <= 1.5); broadcast_tcp_s_1 / broadcast_tcp_s_4 / tcp_fanout4_over_fanout1 (ours
with transport="tcp", the cross-host path, for reference); publish_s (the publisher's hash-and-snapshot part
of a broadcast); apply_s_hf (publish until the weights are loaded into an HF model with HFBackend.load_weights
in the subscriber process); cpus.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np
import zmq

HIDDEN, FFN, HEADS, KV_HEADS = 512, 1536, 8, 2


def _config(target_bytes: int) -> dict[str, Any]:
    """Qwen2 config kwargs whose float32 state dict is about `target_bytes`."""
    vocab = 8192 if target_bytes >= 128 << 20 else 2048
    per_layer = 4 * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN * KV_HEADS // HEADS + 3 * HIDDEN * FFN)
    layers = max(1, round((target_bytes - 2 * 4 * vocab * HIDDEN) / per_layer))
    return dict(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=False,
    )  # fmt: skip


def _payload(cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(tuple(v.shape), np.float32) for k, v in model.state_dict().items()}


# ---- subscriber processes -------------------------------------------------------------------------------
def _subscriber_main(kind: str, endpoint: str, ack: str, sub_id: int, last: int, cfg: dict[str, Any]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(ack)
    if kind == "raw":
        _raw_receiver(ctx, endpoint, out, sub_id, last)
    else:
        _weight_receiver(kind, endpoint, out, sub_id, last, cfg)
    out.close(linger=1000)
    ctx.term()


def _raw_receiver(ctx: zmq.Context, endpoint: str, out: zmq.Socket, sub_id: int, last: int) -> None:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    out.send_string(f"{sub_id} ready")
    for v in range(1, last + 1):
        frames = sock.recv_multipart(copy=False)
        assert len(frames) > 0
        out.send_string(f"{sub_id} {v}")
    sock.close(linger=0)


def _weight_receiver(kind: str, endpoint: str, out: zmq.Socket, sub_id: int, last: int, cfg: dict) -> None:
    from actors.weight_subscriber import WeightSubscriber

    backend = None
    if kind == "apply":
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from actors.policy.hf_backend import HFBackend

        with torch.device("meta"):
            model = Qwen2ForCausalLM(Qwen2Config(**cfg))
        backend = HFBackend(model.to_empty(device="cpu"))  # values come from the broadcast
    sub = WeightSubscriber(endpoint, transport="tcp" if kind == "tcp" else "auto")
    out.send_string(f"{sub_id} ready")
    version = -1
    while version < last:
        got = sub.poll(timeout_ms=100)
        if got is None:
            continue
        version, tensors = got
        if backend is not None:
            backend.load_weights(tensors, version)
        del tensors
        out.send_string(f"{sub_id} {version}")
    sub.close()


# ---- the parent ------------------------------------------------------------------------------------------
class _Group:
    """n subscriber processes of one kind, acknowledging on a PULL socket."""

    def __init__(self, kind: str, n: int, endpoint: str, last: int, cfg: dict[str, Any]) -> None:
        self.ctx = zmq.Context()
        self.acks = self.ctx.socket(zmq.PULL)
        port = self.acks.bind_to_random_port("tcp://127.0.0.1")
        spawn = mp.get_context("spawn")
        args = (kind, endpoint, f"tcp://127.0.0.1:{port}")
        self.procs = [spawn.Process(target=_subscriber_main, args=(*args, i, last, cfg)) for i in range(n)]
        for p in self.procs:
            p.start()
        self.wait("ready", timeout=300)

    def wait(self, what: str, timeout: float = 120) -> None:
        pending = set(range(len(self.procs)))
        deadline = time.monotonic() + timeout
        while pending:
            if not self.acks.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"subscribers {sorted(pending)} never acknowledged {what}")
            sub_id, got = self.acks.recv_string().split()
            if got == what:
                pending.discard(int(sub_id))

    def close(self) -> None:
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        self.acks.close(linger=0)
        self.ctx.term()


def _time_ours(pub: Any, payload: dict, kind: str, n: int, reps: int, cfg: dict) -> tuple[float, float]:
    """Best (broadcast seconds, publisher seconds) over `reps` publishes to n fresh subscribers."""
    first = pub.version + 1
    group = _Group(kind, n, pub.endpoint, first + reps, cfg)
    best, best_pub = float("inf"), float("inf")
    try:
        for v in range(first, first + reps + 1):  # the first is the warm-up
            while not pub.stats()["spare_ready"]:
                time.sleep(0.01)
            time.sleep(0.2)
            t0 = time.perf_counter()
            pub.publish(payload, v)
            group.wait(str(v))
            if v > first:
                best = min(best, time.perf_counter() - t0)
                best_pub = min(best_pub, pub.stats()["publish_s"])
    finally:
        group.close()
    return best, best_pub


def _time_raw(payload: dict, reps: int) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    group = _Group("raw", 1, f"tcp://127.0.0.1:{port}", reps + 1, {})
    frames = list(payload.values())
    best = float("inf")
    try:
        for v in range(1, reps + 2):
            time.sleep(0.2)
            t0 = time.perf_counter()
            sock.send_multipart(frames, copy=False)
            group.wait(str(v))
            if v > 1:
                best = min(best, time.perf_counter() - t0)
    finally:
        group.close()
        sock.close(linger=0)
        ctx.term()
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    from learner.weight_publisher import WeightPublisher

    quick = bool(getattr(args, "quick", False))
    reps = 2 if quick else 3
    cfg = _config((32 if quick else 256) << 20)
    payload = _payload(cfg)
    nbytes = sum(a.nbytes for a in payload.values())
    raw_1 = _time_raw(payload, reps)
    with WeightPublisher() as pub:
        ours_1, publish_s = _time_ours(pub, payload, "auto", 1, reps, cfg)
        ours_4, _ = _time_ours(pub, payload, "auto", 4, reps, cfg)
        tcp_1, _ = _time_ours(pub, payload, "tcp", 1, reps, cfg)
        tcp_4, _ = _time_ours(pub, payload, "tcp", 4, reps, cfg)
        apply_s, _ = _time_ours(pub, payload, "apply", 1, reps, cfg)
    r = lambda x: round(x, 4)  # noqa: E731
    return {
        "payload_mb": r(nbytes / 2**20), "tensors": len(payload), "reps": reps, "cpus": os.cpu_count(),
        "raw_zmq_s_1": r(raw_1), "broadcast_s_1": r(ours_1), "broadcast_over_raw_zmq": r(raw_1 / ours_1),
        "broadcast_s_4": r(ours_4), "fanout4_over_fanout1": r(ours_4 / ours_1), "publish_s": r(publish_s),
        "broadcast_tcp_s_1": r(tcp_1), "broadcast_tcp_s_4": r(tcp_4),
        "tcp_fanout4_over_fanout1": r(tcp_4 / tcp_1), "apply_s_hf": r(apply_s), "transport": "shm",
    }  # fmt: skip
