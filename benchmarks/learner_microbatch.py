"""The scale half of `treeopsd bench learner`: micro-batch overhead and tree attention on long trees.

microbatch_overhead    learner step time with `learner.max_tokens_per_microbatch` set so that every
                       mini-batch becomes ~4 micro-batches, over the step with one micro-batch per mini-batch
                       (same trees, same weights, interleaved repetitions; process CPU seconds, minimum).
                       Goal ≤ 1.10. `microbatch_recomputed_frac` is the share of forwarded tokens that are
                       context recomputed for split trees.
attention.<n>k         one tree of ~n·1024 packed tokens (an initialize–expand (4,2) tree with long turns),
                       forward + backward of the TreeOPSD loss, block-sparse (chunked SDPA plan) vs dense
                       (the 4D float mask through sdpa): CPU seconds and peak RSS above the process's
                       baseline, each in a fresh process so one peak does not hide another. Dense is not
                       run where its mask alone (`dense_mask_bytes`, T² · 4) exceeds 1 GiB.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import time
from queue import Empty
from typing import Any

import numpy as np
import torch

DENSE_MASK_LIMIT = 1 << 30  # bytes; beyond it the dense mask is reported, not built


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> float:
    """Resets the process's peak RSS (VmHWM) to its current RSS (Linux: "5" > /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mb("VmRSS")


def sized_tree(target_tokens: int, vocab: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """A credited (4,2) tree of about `target_tokens` packed tokens: 6–10 turns per trajectory, turn and
    observation lengths scaled to the target."""
    from benchmarks.workloads import random_rollout_tree
    from configs.schema import parse_config
    from system.credit import credit_rollout_tree

    def build(length: int):  # type: ignore[no-untyped-def]
        rng = np.random.default_rng(seed)
        lo, hi = max(1, length // 2), max(2, length + length // 2)
        return random_rollout_tree(
            rng, "long", vocab, prompt=(64, 64), turn=(lo, hi), obs=(lo, hi), turns=(6, 10)
        )

    guess = max(2, round(64 * target_tokens / build(64).num_tokens))  # tokens grow about ∝ length
    # the structure is redrawn with the length, so take the closest of the lengths around the guess
    tree = min(
        (build(n) for n in range(max(2, guess * 3 // 4), guess * 5 // 4 + 2)),
        key=lambda t: abs(t.num_tokens - target_tokens),
    )
    return credit_rollout_tree(tree, parse_config({}).algo)


def _attention_child(target: int, kind: str, queue: Any) -> None:
    """One forward+backward in this fresh process; puts (cpu_s, peak_rss_mb, tokens) on the queue."""
    torch.set_num_threads(1)
    from actors.policy.tiny_model import build_tiny_model
    from benchmarks.workloads import bench_tokenizer
    from learner.forward import token_logprobs
    from learner.losses import treeopsd_loss
    from learner.packing import pack_tree

    tok = bench_tokenizer()
    model = build_tiny_model(tok, hidden=64, layers=2, heads=2, kv_heads=1, max_positions=65536)
    model.config._attn_implementation = "sdpa"
    packed = pack_tree(sized_tree(target, len(tok)))
    base = _reset_peak()
    c0 = time.process_time()
    logp = token_logprobs(model, packed, "tree" if kind == "sparse" else "mask")
    on = packed.owned & (packed.turn_ids >= 0)
    ids = torch.where(on, packed.turn_ids, -1).flatten()
    loss, _ = treeopsd_loss(logp.flatten(), packed.behavior_logp.flatten(), ids, packed.q)
    loss.backward()
    queue.put((time.process_time() - c0, _status_mb("VmHWM") - base, int(packed.num_tokens)))


def _measure(target: int, kind: str) -> tuple[float, float, int]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_attention_child, args=(target, kind, queue))
    proc.start()
    while True:  # a child that dies (out of memory, say) must fail the benchmark, not hang it
        try:
            result = queue.get(timeout=5)
            break
        except Empty:
            if not proc.is_alive():
                raise RuntimeError(
                    f"attention at {target} tokens ({kind}): exit code {proc.exitcode}"
                ) from None
    proc.join()
    return result


def attention_scaling(sizes_k: tuple[int, ...]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for k in sizes_k:
        cpu, peak, tokens = _measure(k * 1024, "sparse")
        row = {"tokens": tokens, "sparse_step_s": round(cpu, 3), "sparse_peak_mb": round(peak, 1)}
        row["dense_mask_bytes"] = tokens * tokens * 4
        if row["dense_mask_bytes"] <= DENSE_MASK_LIMIT:
            d_cpu, d_peak, _ = _measure(k * 1024, "dense")
            row.update(dense_step_s=round(d_cpu, 3), dense_peak_mb=round(d_peak, 1))
            row["dense_over_sparse_time"] = round(d_cpu / cpu, 3)
        out[f"{k}k"] = row
    return out


def _budget_for_four(trees, learner_with) -> int:  # type: ignore[no-untyped-def]
    """The smallest token budget (in 2.5 % steps from a quarter of a mini-batch) whose plan splits the 4
    mini-batches into at most 4 micro-batches each, as the figure is defined; first-fit fills pieces to less
    than the budget, so a quarter alone gives 5 or more."""
    per_mb = sum(t.num_tokens for t in trees) / 4  # 4 mini-batches of whole trees
    for step in range(41):
        budget = int(np.ceil(per_mb / 4 * (1 + 0.025 * step)))
        batches, _ = learner_with(budget).plan(trees)
        if sum(len(micro) for micro in batches) <= 16:
            return budget
    return budget


def microbatch_overhead(model, trees, reps: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Step time with ~4 micro-batches per mini-batch over one micro-batch per mini-batch."""
    from configs.schema import parse_config
    from learner.learner import Learner

    def cfg(budget: int):  # type: ignore[no-untyped-def]
        keys = {"batch_trees": 8, "minibatches": 4, "lr": 1e-4, "max_tokens_per_microbatch": budget}
        return parse_config({"learner": keys})

    budget = _budget_for_four(trees, lambda b: Learner(model, cfg(b)))
    learners = {name: Learner(copy.deepcopy(model), cfg(b)) for name, b in (("one", 0), ("four", budget))}
    times: dict[str, list[float]] = {k: [] for k in learners}
    stats: dict[str, dict[str, float]] = {}
    for rep in range(reps + 1):
        for name, learner in learners.items():
            c0 = time.process_time()
            stats[name] = learner.step(trees)
            if rep:
                times[name].append(time.process_time() - c0)
    one, four = min(times["one"]), min(times["four"])
    forwarded = stats["four"]["learner/tokens"]
    return {
        "microbatch_overhead": round(four / one, 3),
        "microbatch_budget": budget,
        "microbatches_per_minibatch": stats["four"]["learner/microbatches"] / 4,
        "microbatch_recomputed_frac": round(1 - stats["one"]["learner/tokens"] / forwarded, 4),
        "one_microbatch_step_s": round(one, 4),
        "four_microbatch_step_s": round(four, 4),
    }
