"""`treeopsd bench learner --json`: one learner step, tree-packed vs path-by-path, on (M,N) = (4,2) trees.

Batch: 8 credited trees (the default `learner.batch_trees`) in 4 sequential mini-batches, TreeOPSD loss,
AdamW; each tree has a ~60-token prompt, 4 trajectories of 2–5 turns (15–40 model tokens, ~40 observation
tokens each) and 2 branches per trajectory. Every configuration trains its own copy of the same initial
weights; repetitions are interleaved (packed, paths, packed, ...) so a noisy shared CPU hits all alike.

Step times are process CPU seconds (one torch thread, so CPU time is the step's own work: on a dedicated core
it equals wall time, and on a shared machine it leaves out the time the scheduler gave to other processes),
the minimum over repetitions (contention only ever adds time). `models.*.wall_*` keep the wall-clock minima
and medians for comparison.

Models: the headline figures are measured on the reference model `ref_h256_l4` (hidden 256, 4 layers, 4
heads / 2 KV heads, MLP 1024, vocab 1024: 4.2 M parameters), where the decoder layers carry most of a step's
work, as in real LLMs; the `*_tiny` keys repeat them for the tiny model of the tests (hidden 64, 2 layers:
0.2 M parameters), where the LM head over the loss tokens and the per-kernel dispatch are a large fixed share
of each forward. `--quick` runs the tiny model only (and reports it under the headline keys too).

Keys (`models` holds every model's step times):
    packed_step_s        tree-packed step (every stored token once, block-sparse tree attention)
    paths_step_s         path-by-path step: one causal sequence per leaf, varlen-packed without padding and
                         run through the same attention kernel, so only the repeated prefixes differ
    packed_speedup       paths_step_s / packed_step_s (goal ≥ 1.4)
    paths_padded_step_s  path-by-path as right-padded rows with the model's own causal sdpa (naive baseline)
    packed_dense_mask_step_s  tree-packed with the dense 4D float mask (eager/sdpa), tiny model only
    tokens_packed, tokens_paths  tokens forwarded per step by each layout
    packed_speedup_limit tokens_paths / tokens_packed: what packing would give if time were ∝ tokens;
                         packed_speedup_of_limit = packed_speedup / that limit (goal ≥ 0.9). Only the
                         decoder's per-token work scales with that ratio: attention costs ∝ each token's
                         context, and the shared tokens packing removes are the early ones with short
                         contexts; the LM head runs on loss tokens only, and the prompt (shared by every
                         leaf) is none. So the fraction rises with the decoder's share of the step.
    microbatch_*, attention  token-budget micro-batches and long-tree attention (learner_microbatch.py)
"""

from __future__ import annotations

import copy
import statistics
import time

import numpy as np
import torch

from actors.policy.tiny_model import build_tiny_model
from benchmarks.learner_microbatch import attention_scaling, microbatch_overhead
from benchmarks.workloads import bench_tokenizer, random_rollout_tree
from configs.schema import parse_config
from learner.learner import Learner
from learner.packing import pack_paths
from system.credit import credit_rollout_tree
from system.tree import RolloutTree


def _learner(model, packed: bool, attention: str) -> Learner:
    cfg = parse_config(
        {"learner": {"batch_trees": 8, "minibatches": 4, "packed_forward": packed, "lr": 1e-4}}
    )
    return Learner(copy.deepcopy(model), cfg, attention=attention)


def _time(learners: dict[str, Learner], trees: list[RolloutTree], reps: int):
    """(CPU seconds, wall seconds) per configuration and repetition."""
    cpu: dict[str, list[float]] = {k: [] for k in learners}
    wall: dict[str, list[float]] = {k: [] for k in learners}
    for rep in range(reps + 1):  # rep 0 warms up (allocator, plan caches, lazy init)
        for name, learner in learners.items():
            c0, w0 = time.process_time(), time.perf_counter()
            learner.step(trees)
            if rep:
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
    return cpu, wall


def _bench_model(model, trees: list[RolloutTree], reps: int, dense: bool) -> dict[str, float]:
    learners = {
        "packed": _learner(model, True, "tree"),
        "paths": _learner(model, False, "tree"),
        "paths_padded": _learner(model, False, "mask"),
    }
    if dense:
        learners["packed_dense_mask"] = _learner(model, True, "mask")
    cpu, wall = _time(learners, trees, reps)
    t = {k: min(v) for k, v in cpu.items()}
    out: dict[str, float] = {f"{k}_step_s": round(v, 4) for k, v in t.items()}
    out["packed_speedup"] = round(t["paths"] / t["packed"], 3)
    out["packed_speedup_vs_padded"] = round(t["paths_padded"] / t["packed"], 3)
    for stat, fn in (("min", min), ("median", statistics.median)):
        w = {k: fn(v) for k, v in wall.items()}
        out.update({f"wall_{stat}_{k}_step_s": round(v, 4) for k, v in w.items()})
        out[f"wall_{stat}_packed_speedup"] = round(w["paths"] / w["packed"], 3)
    out["reps"] = reps
    out.update(_host_work(learners["packed"], trees))
    return out


def _host_work(learner: Learner, trees: list[RolloutTree]) -> dict[str, float]:
    """Planning and packing a step's micro-batches (the CPU work before any kernel: splitting, packing,
    padding, copies to the device), per micro-batch in ms and as a share of the packed step (CPU time)."""
    c0 = time.process_time()
    batches, _ = learner.plan(trees)
    host = time.process_time() - c0
    micro = sum(len(m) for m in batches)
    return {"host_ms_per_microbatch": round(1e3 * host / max(micro, 1), 3), "host_s": round(host, 4)}


TINY, REFERENCE = "tiny_h64_l2", "ref_h256_l4"
SHAPES = {TINY: (64, 2, 2, 1), REFERENCE: (256, 4, 4, 2)}  # hidden, layers, heads, KV heads
REPS = {TINY: 7, REFERENCE: 3}  # interleaved repetitions per configuration (the minimum counts)
MICRO_REPS = {TINY: 10, REFERENCE: 3}  # a tiny step's CPU time varies by ±15% on a shared machine


def _build(tok, name: str):  # type: ignore[no-untyped-def]
    hidden, layers, heads, kv = SHAPES[name]
    return build_tiny_model(tok, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, max_positions=4096)


def _model_figures(tok, trees: list[RolloutTree], name: str, quick: bool, tokens: tuple[int, int]) -> dict:  # type: ignore[no-untyped-def]
    """One model's packed-vs-paths step times and its micro-batch overhead."""
    model = _build(tok, name)
    model.config._attn_implementation = "sdpa"
    steps = _bench_model(model, trees, 1 if quick else REPS[name], dense=name == TINY and not quick)
    packed, paths = tokens
    scale = microbatch_overhead(_build(tok, name), trees, reps=1 if quick else MICRO_REPS[name])
    return {
        "steps": steps,
        "params": sum(p.numel() for p in model.parameters()),
        "headline": {
            "packed_step_s": steps["packed_step_s"],
            "paths_step_s": steps["paths_step_s"],
            "packed_speedup": steps["packed_speedup"],
            "packed_speedup_of_limit": round(steps["packed_speedup"] * packed / paths, 3),
            "paths_padded_step_s": steps["paths_padded_step_s"],
            "host_ms_per_microbatch": steps["host_ms_per_microbatch"],
            "host_frac": round(steps["host_s"] / steps["packed_step_s"], 4),
            "packed_speedup_vs_padded": steps["packed_speedup_vs_padded"],
            **scale,
        },
    }


def run(args) -> dict:
    if getattr(args, "device", None) or getattr(args, "shape", None):  # real shapes (learner_gpu.py)
        from benchmarks.learner_gpu import run as run_shapes

        return run_shapes(args)
    quick = bool(getattr(args, "quick", False))
    torch.set_num_threads(1)
    tok = bench_tokenizer()
    rng = np.random.default_rng(0)
    cfg = parse_config({})
    trees = [credit_rollout_tree(random_rollout_tree(rng, f"t{i}", len(tok)), cfg.algo) for i in range(8)]
    tokens_paths = int(pack_paths(trees).valid.sum())
    tokens_packed = int(sum(t.num_tokens for t in trees))
    names = [TINY] if quick else [TINY, REFERENCE]
    figures = {n: _model_figures(tok, trees, n, quick, (tokens_packed, tokens_paths)) for n in names}
    head = figures[names[-1]]["headline"]
    tiny = {f"{k}_tiny": v for k, v in figures[TINY]["headline"].items()}
    attention = attention_scaling((2,) if quick else (2, 8, 32))
    return {
        **head,
        "packed_speedup_limit": round(tokens_paths / tokens_packed, 3),  # the speedup if time ∝ tokens
        "headline_model": names[-1],
        "headline_params": figures[names[-1]]["params"],
        **tiny,
        **_attention_headline(attention),
        "attention": attention,
        "tokens_packed": tokens_packed,
        "tokens_paths": tokens_paths,
        "models": {n: f["steps"] for n, f in figures.items()},
        "trees": len(trees),
        "leaves": int(sum(t.num_leaves for t in trees)),
        "minibatches": 4,
        "method": "treeopsd",
        "threads": 1,
    }


def _attention_headline(attention: dict[str, dict[str, float]]) -> dict[str, float]:
    """Flat headline figures of the long-tree attention rows (the largest size with a dense run, the
    largest size overall)."""
    dense = [k for k, row in attention.items() if "dense_step_s" in row]
    out: dict[str, float] = {}
    if dense:
        out["attention_dense_over_sparse"] = attention[dense[-1]]["dense_over_sparse_time"]
        out["attention_dense_over_sparse_at"] = attention[dense[-1]]["tokens"]
    last = list(attention.values())[-1]
    out["attention_largest_tokens"] = last["tokens"]
    out["attention_largest_sparse_step_s"] = last["sparse_step_s"]
    out["attention_largest_sparse_peak_mb"] = last["sparse_peak_mb"]
    out["attention_largest_dense_mask_mb"] = round(last["dense_mask_bytes"] / 2**20, 1)
    return out
