"""`treeopsd bench learner --device cuda --shape qwen3-0.6b`: the learner at real shapes, tree-packed against
path-by-path on the same trees (`make gpu-bench`; `--device cpu --shape tiny` runs the same code in CI).

Model: a random-init Qwen3 built from the shape's config dimensions on the device (no download; vocab
151,936, tied embeddings, head_dim 128). Workload: each step is 4 credited (M,N) = (4,2) trees of the shape
a thinking search agent produces (prompt 300–600 tokens, turns 100–500, observations 150–450, 3–6 turns per
trajectory; ~92k packed tokens, ~160k path by path), a fresh draw every step (so lengths vary as in a run);
TreeOPSD, 2 mini-batches, bf16 on CUDA, gradient checkpointing, `max_tokens_per_microbatch = 16384`.

Figures per layout (`packed`: every stored token once; `paths`: one causal sequence per leaf, varlen in one
row, the same kernel), each printed to stderr as a JSON line the moment it is measured:

    first_step_s        the first step, compiles included
    step_s              median of the timed steps (after the first)
    tokens_per_s        real tokens the layout forwards per second (packed: the trees' tokens)
    path_tokens_per_s   the trees' root-to-leaf tokens per second: what a path-by-path learner would have
                        to forward to train the same batch (= tokens_per_s for `paths`)
    mfu                 6·N·T / step_s / peak, N = parameters (tied embedding once), T = real tokens
                        forwarded, peak = 989 TFLOP/s (H100/H200 dense bf16); attention FLOPs and the
                        checkpointing recompute are not counted (prime-rl's convention)
    peak_gib            torch.cuda.max_memory_allocated over the layout's steps, beside `model_gib`,
                        the memory model below
    compiles            graphs torch.compile built by the end of the layout's steps (process total)
    pad_frac            padding share of the columns forwarded (flex length buckets)
    host_s, host_frac   planning and packing of a step's micro-batches (CPU), and its share of a step

Memory model (bytes, N parameters, T tokens of the largest micro-batch, L layers, d hidden, f MLP width,
q/kv the query/key-value widths, c the LM-head chunk, V the vocab): 16·N for fp32 weights, gradients and
AdamW's two moments; checkpointed activations 4·T·d·L (the fp32 residual stream at each layer boundary);
one layer recomputed and differentiated ≈ 2 · 2·T·(3·d + 2·q + 2·kv + 3·f) (bf16 tensors, and their
gradients); the LM head's chunk 3 · 4·c·V (logits, their softmax and gradient, fp32).
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from configs.schema import Config, parse_config
from learner.learner import Learner
from learner.packing import pack_paths
from system.credit import credit_rollout_tree
from system.tree import RolloutTree

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16
VOCAB = 151_936
# hidden, MLP width, layers, query heads, KV heads (Qwen3 configs; head_dim 128, tied embeddings)
SHAPES = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8),
    "qwen3-4b": (2560, 9728, 36, 32, 8),
    "tiny": (64, 128, 2, 4, 2),
}
BUDGET = 16_384
TREE_SHAPE = {"prompt": (300, 600), "turn": (100, 500), "obs": (150, 450), "turns": (3, 6)}


def emit(line: dict[str, Any]) -> None:
    """One figure, as soon as it exists: a JSON line on stderr (stdout keeps the one JSON object)."""
    print(json.dumps(line, sort_keys=True), file=sys.stderr, flush=True)


def build_model(shape: str, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A random-init Qwen3 of `shape` built on `device` (tiny: a small vocabulary too)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, mlp, layers, heads, kv = SHAPES[shape]
    config = Qwen3Config(
        vocab_size=1024 if shape == "tiny" else VOCAB,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=16 if shape == "tiny" else 128,
        max_position_embeddings=40_960,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3ForCausalLM(config)


def draw_batch(rng: np.random.Generator, vocab: int, step: int, cfg: Config, tiny: bool) -> list[RolloutTree]:
    """4 credited (4,2) trees of the agentic shape (tiny: 10× shorter turns, for the CPU)."""
    from benchmarks.workloads import random_rollout_tree

    shape = TREE_SHAPE
    if tiny:
        shape = {
            k: (max(1, a // 10), max(2, b // 10)) if k != "turns" else (a, b) for k, (a, b) in shape.items()
        }
    trees = [random_rollout_tree(rng, f"s{step}t{i}", vocab, **shape) for i in range(4)]
    return [credit_rollout_tree(t, cfg.algo) for t in trees]


def learner_config(device: torch.device, packed: bool, budget: int, overrides: list[str]) -> Config:
    """The workload's learner keys (module docstring), then the user's `--set` overrides."""
    gpu = device.type == "cuda"
    return parse_config(
        {
            "learner": {
                "batch_trees": 4,
                "minibatches": 2,
                "packed_forward": packed,
                "precision": "bfloat16" if gpu else "float32",
                "grad_checkpointing": True,
                "max_tokens_per_microbatch": budget,
                "lr": 1e-5,
            },
            "resources": {"learner": {"num_gpus": 1 if gpu else 0}},
        },
        overrides,
    )


def model_bytes(shape: str, params: int, tokens: int, chunk: int) -> dict[str, float]:
    """The module docstring's memory model, in GiB, per part and in all."""
    hidden, mlp, layers, heads, kv = SHAPES[shape]
    head_dim = 16 if shape == "tiny" else 128
    q, kvw, vocab = heads * head_dim, kv * head_dim, 1024 if shape == "tiny" else VOCAB
    parts = {
        "states": 16.0 * params,
        "checkpoints": 4.0 * tokens * hidden * layers,
        "layer": 2 * 2.0 * tokens * (3 * hidden + 2 * q + 2 * kvw + 3 * mlp),
        "lm_head": 3 * 4.0 * min(chunk, tokens) * vocab,
    }
    out = {f"model_{k}_gib": round(v / 2**30, 2) for k, v in parts.items()}
    out["model_gib"] = round(sum(parts.values()) / 2**30, 2)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_seconds(learner: Learner, trees: list[RolloutTree]) -> float:
    """Planning and packing a step's micro-batches (what runs on the CPU before any kernel)."""
    t0 = time.perf_counter()
    learner.plan(trees)
    return time.perf_counter() - t0


def _timed_steps(learner: Learner, shape: str, layout: str, steps: int) -> list[dict[str, float]]:
    """`steps` learner steps on fresh draws (seeded alike for both layouts): per step its wall time, host
    time, stats and the trees' root-to-leaf tokens, each step also emitted as a line."""
    rng = np.random.default_rng(7)
    vocab = learner.model.config.vocab_size
    records = []
    for step in range(steps):
        trees = draw_batch(rng, vocab, step, learner.cfg, shape == "tiny")
        host = _host_seconds(learner, trees)
        _sync(learner.device)
        t0 = time.perf_counter()
        stats = learner.step(trees)
        _sync(learner.device)
        wall = time.perf_counter() - t0
        records.append({**stats, "wall": wall, "host": host, "paths": float(pack_paths(trees).valid.sum())})
        line = {"shape": shape, "layout": layout, "step": step, "step_s": round(wall, 3)}
        line.update(compiles=stats["learner/compiles"], pad_frac=round(stats["learner/pad_frac"], 4))
        emit(line)
    return records


def _figures(records: list[dict[str, float]], params: int) -> dict[str, Any]:
    """The module docstring's figures from the timed steps (all but the first, unless there is one)."""
    from learner.flex_attention import compiled_graphs

    timed = records[1:] if len(records) > 1 else records
    step_s = statistics.median(r["wall"] for r in timed)
    real = statistics.mean(r["learner/forwarded_tokens"] for r in timed)
    paths = statistics.mean(r["paths"] for r in timed)
    host = statistics.median(r["host"] for r in timed)
    return {
        "params": params,
        "steps": len(records),
        "first_step_s": round(records[0]["wall"], 2),
        "step_s": round(step_s, 3),
        "tokens_per_step": round(real),
        "path_tokens_per_step": round(paths),
        "tokens_per_s": round(real / step_s),
        "path_tokens_per_s": round(paths / step_s),
        "mfu": round(6 * params * real / step_s / PEAK_FLOPS, 4),
        "compiles": compiled_graphs(),
        "pad_frac": round(statistics.mean(r["learner/pad_frac"] for r in records), 4),
        "microbatches": statistics.mean(r["learner/microbatches"] for r in records),
        "host_s": round(host, 3),
        "host_frac": round(host / step_s, 4),
    }


def bench_layout(shape: str, layout: str, device: torch.device, steps: int, args: Any) -> dict[str, Any]:
    """One layout's figures over `steps` steps (the first one, with its compiles, reported apart)."""
    budget = BUDGET if device.type == "cuda" else 1024
    cfg = learner_config(device, layout == "packed", budget, list(getattr(args, "set", None) or []))
    model = build_model(shape, device)
    params = sum(p.numel() for p in model.parameters())
    learner = Learner(model, cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    records = _timed_steps(learner, shape, layout, steps)
    if getattr(args, "profile", False) and layout == "packed":
        emit({"shape": shape, "layout": layout, "profile": profile_step(learner, shape)})
    out: dict[str, Any] = {"shape": shape, "layout": layout, "attention": learner.attention}
    out.update(_figures(records, params))
    if device.type == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        out["reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    largest = budget if budget > 0 else int(max(r["learner/forwarded_tokens"] for r in records))
    out.update(model_bytes(shape, params, largest, cfg.learner.logprob_chunk_tokens))
    emit(out)
    del learner, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run(args: Any) -> dict[str, Any]:
    """`bench learner --device D --shape S [--steps K]`: packed (K steps) then paths (≤ 2), their ratio."""
    device = torch.device(getattr(args, "device", None) or "cpu")
    shapes = [s.strip() for s in (getattr(args, "shape", None) or "tiny").split(",")]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"--shape {unknown[0]!r} is not one of {sorted(SHAPES)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda but torch {torch.__version__} sees no CUDA device")
    steps = int(getattr(args, "steps", None) or (2 if device.type == "cpu" else 4))
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for shape in shapes:
        # paths: 2 steps at most (the reference; the compile count is the packed run's)
        rows = {
            "packed": bench_layout(shape, "packed", device, steps, args),
            "paths": bench_layout(shape, "paths", device, min(steps, 2), args),
        }
        rows["packed_over_paths"] = {
            "step_speedup": round(rows["paths"]["step_s"] / rows["packed"]["step_s"], 3),
            "path_tokens_per_s": rows["packed"]["path_tokens_per_s"],
        }
        emit({"shape": shape, **rows["packed_over_paths"]})
        out[shape] = rows
    out["overrides"] = list(getattr(args, "set", None) or [])
    out.update(
        {
            "budget": BUDGET if device.type == "cuda" else 1024,
            "torch": torch.__version__,
            "method": "treeopsd",
            "trees_per_step": 4,
        }
    )
    return out


# kernel-name patterns → the part of a step they belong to (first match wins)
KERNEL_PARTS = (
    ("attention", ("flex", "attention", "triton_tem")),
    ("fp32_gemm", ("sgemm", "tf32", "s1688", "f32_f32")),
    ("bf16_gemm", ("gemm", "cutlass", "nvjet", "xmma")),
    ("optimizer", ("adam", "multi_tensor")),
)


def profile_step(learner: Learner, shape: str) -> dict[str, Any]:
    """One more step under torch.profiler: the device time by part (KERNEL_PARTS) and the 12 kernels that
    took the most; on the CPU, the CPU ops instead."""
    from torch.profiler import ProfilerActivity, profile

    cuda = learner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    vocab = learner.model.config.vocab_size
    trees = draw_batch(np.random.default_rng(99), vocab, 0, learner.cfg, shape == "tiny")
    with profile(activities=activities) as prof:
        learner.step(trees)
        _sync(learner.device)

    def time_of(e: Any) -> float:
        return float(e.self_device_time_total if cuda else e.self_cpu_time_total)

    def is_kernel(e: Any) -> bool:  # an aten op also carries its kernels' device time: count kernels once
        return not cuda or str(getattr(e, "device_type", "")).endswith("CUDA")

    events = [e for e in prof.key_averages() if time_of(e) > 0 and is_kernel(e)]
    total = sum(time_of(e) for e in events) or 1.0
    parts: dict[str, float] = {}
    for e in events:
        name = e.key.lower()
        part = next((p for p, keys in KERNEL_PARTS if any(k in name for k in keys)), "other")
        parts[part] = parts.get(part, 0.0) + time_of(e)
    top = sorted(events, key=time_of, reverse=True)[:12]
    return {
        "busy_s": round(total / 1e6, 3),
        "share": {k: round(v / total, 3) for k, v in sorted(parts.items())},
        "top": [{"kernel": e.key[:90], "s": round(time_of(e) / 1e6, 3), "calls": e.count} for e in top],
    }
