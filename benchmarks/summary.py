"""Markdown summary of `treeopsd bench all`: each headline figure beside its goal and the baseline it was
measured against in the same run (`make bench` writes it to benchmarks/results/bench.md)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

# (benchmark, figure, goal operator, goal, baseline keys shown beside it, what the figure is)
GOALS: tuple[tuple[str, str, str, float | None, tuple[str, ...], str], ...] = (
    (
        "store",
        "zero_copy_over_pickle",
        ">=",
        10.0,
        ("read_zero_copy_mb_s", "pickle_read_mb_s"),
        "zero-copy Arrow reads over pickle, same nodes",
    ),
    (
        "store",
        "commit_over_reencode",
        ">=",
        1.0,
        ("write_mb_s", "write_reencode_mb_s"),
        "durable commits of the received IPC bytes over decode + re-encode (fsync + rename)",
    ),
    (
        "sampler",
        "sampler_over_raw",
        ">=",
        0.9,
        ("sampler_tokens_per_s", "raw_tokens_per_s"),
        "agent loop + trees over the bare backend, same requests",
    ),
    (
        "sampler",
        "recompute_saved_frac",
        "",
        None,
        ("prefix_tokens_recomputed", "prefix_tokens_total"),
        "branch-prefix tokens served from the prefix cache",
    ),
    (
        "sampler",
        "sampler_over_raw_64",
        ">=",
        0.95,
        ("sampler_64_tokens_per_s", "raw_64_tokens_per_s"),
        "async sampler at 64 episodes in flight over the bare async engine, same requests",
    ),
    (
        "sampler",
        "async_over_lockstep",
        ">=",
        1.3,
        ("async_trees_per_s", "lockstep_trees_per_s"),
        "trees/s of the async loop over the lockstep loop, long-tailed turns (1 in 10 takes 8x)",
    ),
    (
        "learner",
        "packed_speedup",
        ">=",
        1.4,
        ("packed_step_s", "paths_step_s"),
        "tree-packed step over path-by-path, (4,2) trees",
    ),
    (
        "learner",
        "packed_speedup_of_limit",
        ">=",
        0.9,
        ("packed_speedup", "packed_speedup_limit", "packed_speedup_of_limit_tiny"),
        "packed speedup over its limit tokens_paths / tokens_packed",
    ),
    (
        "learner",
        "microbatch_overhead",
        "<=",
        1.10,
        (
            "four_microbatch_step_s",
            "one_microbatch_step_s",
            "microbatch_recomputed_frac",
            "microbatch_overhead_tiny",
        ),
        "step with ~4 token-budget micro-batches per mini-batch over one",
    ),
    (
        "learner",
        "attention_dense_over_sparse",
        ">=",
        1.0,
        ("attention_dense_over_sparse_at",),
        "dense-mask attention time over block-sparse, one long tree (tokens beside)",
    ),
    (
        "learner",
        "attention_largest_sparse_peak_mb",
        "",
        None,
        ("attention_largest_tokens", "attention_largest_dense_mask_mb"),
        "block-sparse peak memory on the largest tree, where the dense mask alone would need this many MB",
    ),
    (
        "pipeline",
        "async_over_sync",
        ">=",
        1.6,
        ("async_trees_per_s", "sync_trees_per_s", "pipeline_bound"),
        "asynchronous over synchronous trees/s (limit: pipeline_bound <= 2)",
    ),
    (
        "weights",
        "broadcast_over_raw_zmq",
        ">=",
        0.8,
        ("broadcast_s_1", "raw_zmq_s_1", "payload_mb"),
        "broadcast to 1 subscriber over a bare pyzmq send of the same bytes",
    ),
    (
        "weights",
        "fanout4_over_fanout1",
        "<=",
        1.5,
        ("broadcast_s_4", "broadcast_s_1"),
        "time to 4 subscribers over time to 1",
    ),
    ("weights", "apply_s_hf", "", None, ("payload_mb",), "publish until loaded into an HF model"),
    (
        "weights",
        "inplace_over_file",
        ">=",
        1.5,
        ("inplace_s_vllm", "file_s_vllm", "inplace_staged_s_vllm"),
        "a received bf16 version into a bf16 vLLM engine in place (its memfd mapped by the workers) over the "
        "file-based reload, same version",
    ),
    ("weights", "apply_s_vllm", "", None, ("vllm_payload_mb",), "publish until loaded into a vLLM engine"),
    (
        "credit",
        "treeopsd_minus_grpo_lo",
        ">=",
        0.0,
        ("treeopsd_minus_grpo", "treeopsd_minus_grpo_hi", "credit_auc_treeopsd", "credit_auc_grpo"),
        "lower end of the 95% interval of TreeOPSD's turn-credit AUC minus GRPO's broadcast advantage's "
        "(paired, same trees): ≥ 0 confirms the paper's mechanism here",
    ),
    (
        "retrieval",
        "shared_over_inprocess_rss",
        "<=",
        0.5,
        ("shared_total_mb", "inprocess_total_mb", "passages"),
        "memory of 4 samplers sharing the retrieval service over 4 in-process indexes",
    ),
    ("retrieval", "qps", "", None, ("p50_ms", "p99_ms", "clients"), "retrieval service queries/s"),
    (
        "learner_ranks",
        "dp2_over_dp1",
        ">=",
        1.7,
        ("dp2_tokens_per_s", "dp1_tokens_per_s", "dp2_over_dp1_cpu", "loadavg_1m"),
        "learner tokens/s of 2 FSDP2 ranks (gloo, 1 thread each) over 1 rank, same trees (limit 2)",
    ),
    (
        "learner_ranks",
        "fsdp2_state_bytes_ratio",
        "<=",
        0.55,
        ("state_bytes_dp2", "state_bytes_dp1"),
        "per-rank parameter + gradient + AdamW bytes, 2 ranks over 1 (limit 0.5)",
    ),
    (
        "view",
        "first_page_s",
        "<=",
        2.0,
        ("trees", "segments", "index_all_s", "filtered_page_s"),
        "`treeopsd view`: the list's first page over HTTP from a cold server, 10,000 small trees",
    ),
    ("view", "tree_s", "<=", 1.0, ("tree_p50_s",), "`treeopsd view`: one tree over HTTP (first, cold)"),
)
_OPS = {">=": operator.ge, "<=": operator.le}


def _num(x: Any) -> str:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return str(x)
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"


def verdicts(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per GOALS entry: value, goal, baselines, and whether the goal holds (None: no goal or no value)."""
    out = []
    for bench, key, op, goal, base_keys, what in GOALS:
        res = results.get(bench) or {}
        value = res.get(key)
        ok = None
        if op and isinstance(value, int | float) and goal is not None:
            ok = bool(_OPS[op](value, goal))
        baselines = {k: res[k] for k in base_keys if k in res}
        out.append(
            {
                "bench": bench,
                "figure": key,
                "value": value,
                "goal": f"{op} {goal:g}" if op else "",
                "ok": ok,
                "baselines": baselines,
                "what": what,
                "error": res.get("error"),
            }
        )
    return out


def render(results: Mapping[str, Mapping[str, Any]], provenance: str = "") -> str:
    lines = ["# Benchmarks (`make bench`)", ""]
    if provenance:
        lines += [provenance, ""]
    lines += [
        "| benchmark | figure | measured | goal | baseline / parts (same run) | meets |",
        "|---|---|---:|---|---|---|",
    ]
    for v in verdicts(results):
        measured = _num(v["value"])
        if v["value"] is None:  # the benchmark failed, or did not run for this file
            measured = "error: " + str(v["error"]) if v["error"] else "not run"
        parts = ", ".join(f"{k} {_num(x)}" for k, x in v["baselines"].items())
        ok = {True: "yes", False: "**no**", None: "—"}[v["ok"]]
        lines.append(
            f"| {v['bench']} | `{v['figure']}`: {v['what']} | {measured} | {v['goal'] or '—'} "
            f"| {parts} | {ok} |"
        )
    return "\n".join(lines) + "\n"
