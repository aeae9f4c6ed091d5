"""Replay-store throughput: durable writes, zero-copy mapped reads, and pickle as the baseline.

    treeopsd bench store --json            # 100k+ nodes
    treeopsd bench store --json --quick    # ~10k nodes

Keys: nodes, trees, tokens, bytes (Arrow segment bytes on disk); write_mb_s: put_raw commits of the IPC bytes
a sampler sends (`tree_codec.encode_ipc`, as the store actor receives them): one validation, then the bytes
as they are (write, fsync, rename, fsync dir); write_reencode_mb_s, the same commits the way they were made
before the store committed bytes (decode the IPC into trees, validate, encode again, write), in the same
run; commit_over_reencode = their ratio; write_trees_mb_s: put_raw of RolloutTree objects in one process
(validate, encode once, write); read_zero_copy_mb_s (memory-map every segment, open it, take the
flat columns and touch every token id, loss-mask byte and log-prob), pickle_read_mb_s (pickle.loads of the
same nodes as a list of dicts of Python lists: the usual queue/object-store payload), zero_copy_over_pickle.
Both read rates divide the same Arrow byte count by their time, so their ratio is the speed-up on the same
nodes; pickle_bytes is the pickle's own size. Also: validate_s (system.tree.validate_tree over all trees,
tree by tree, as decode_trees runs it), check_columns_s (the same rules over the encoded columns,
storage/tree_checks.py, as every commit and full reopen runs them), decode_trees_s (RolloutTree objects from
the mapped store) and reopen_s (open with full validation). pickle is imported only here.
"""

from __future__ import annotations

import argparse
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from storage import store_files as sf
from storage.replay_store import ReplayStore
from storage.tree_checks import check_trees
from storage.tree_codec import decode_ipc, decode_trees, encode_ipc, encode_trees, flat_columns
from system.tree import RolloutTree, TurnNode, validate_tree

NODES_PER_TREE = 25
COMMIT_TREES = 64


def _tree(i: int, rng: np.random.Generator) -> RolloutTree:
    """Root + 24 turns in a random branching shape; ~64 model tokens and ~16 observation tokens per turn."""
    parents = [-1, 0] + [int(rng.integers(1, k)) for k in range(2, NODES_PER_TREE)]
    has_kids = set(parents)
    depth = [0] * NODES_PER_TREE
    nodes = [TurnNode(0, -1, 0, *_arrays(0, rng), obs_tokens=rng.integers(0, 50_000, 200, dtype=np.int32))]
    for j in range(1, NODES_PER_TREE):
        depth[j] = depth[parents[j]] + 1
        tokens, mask, lp = _arrays(int(rng.integers(16, 112)), rng)
        obs = rng.integers(0, 50_000, int(rng.integers(0, 32)), dtype=np.int32)
        reward = float("nan") if j in has_kids else float(rng.random())
        nodes.append(
            TurnNode(j, parents[j], depth[j], tokens, mask, lp, obs, int(rng.integers(0, 4)), reward)
        )
    return RolloutTree.build(f"tree-{i}", nodes, prompt_id=f"p{i % 97}")


def _arrays(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mask = rng.random(n) < 0.9
    lp = -rng.exponential(1.0, n).astype(np.float32)
    lp[~mask] = np.nan
    return rng.integers(0, 50_000, n, dtype=np.int32), mask, lp


def _as_dicts(trees: list[RolloutTree]) -> list[dict]:
    return [
        {
            "tree_id": t.tree_id,
            "node_id": n.node_id,
            "parent": n.parent,
            "depth": n.depth,
            "policy_version": n.policy_version,
            "reward": n.reward,
            "tokens": n.tokens.tolist(),
            "loss_mask": n.loss_mask.tolist(),
            "behavior_logprobs": n.behavior_logprobs.tolist(),
            "obs_tokens": n.obs_tokens.tolist(),
        }
        for t in trees
        for n in t.nodes
    ]


def _zero_copy_read(paths: list[Path]) -> tuple[float, float]:
    t0 = time.perf_counter()
    acc = 0.0
    for path in paths:
        for batch in sf.read_segment(path)[1]:
            f = flat_columns(batch)
            acc += float(f.tokens.values.sum(dtype=np.int64)) + float(f.loss_mask.values.sum())
            acc += float(np.nansum(f.behavior_logprobs.values, dtype=np.float64))
    return time.perf_counter() - t0, acc


def _timed_commits(directory: Path, items: list, commit: Callable[[ReplayStore, object], object]) -> float:
    """Seconds to commit every item into a fresh store at `directory`."""
    with ReplayStore(directory) as store:
        t0 = time.perf_counter()
        for item in items:
            commit(store, item)
        return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict:
    num_trees = 400 if getattr(args, "quick", False) else 4000
    rng = np.random.default_rng(0)
    trees = [_tree(i, rng) for i in range(num_trees)]
    t0 = time.perf_counter()
    for t in trees:
        validate_tree(t)  # what decode_trees runs per tree; timed alone to show what it costs
    validate_s = time.perf_counter() - t0
    batches = [encode_trees(trees[k : k + COMMIT_TREES]) for k in range(0, num_trees, COMMIT_TREES)]
    t0 = time.perf_counter()
    for b in batches:
        check_trees(b, flat_columns(b))  # the same rules over the columns: what commits and reopens run
    check_s = time.perf_counter() - t0
    chunks = [trees[k : k + COMMIT_TREES] for k in range(0, num_trees, COMMIT_TREES)]
    wire = [encode_ipc(c) for c in chunks]  # the samplers' side: encoded once, before the store sees them
    with tempfile.TemporaryDirectory(prefix="bench_store_") as d:
        write_s = _timed_commits(Path(d) / "bytes", wire, lambda store, buf: store.put_raw(buf))
        reencode_s = _timed_commits(
            Path(d) / "reencode", wire, lambda store, buf: store.put_raw(decode_ipc(buf))
        )
        trees_s = _timed_commits(Path(d) / "trees", chunks, lambda store, c: store.put_raw(c))
        store = ReplayStore(Path(d) / "bytes")
        stats = store.stats()
        t0 = time.perf_counter()
        decoded = decode_trees(store.read_columns())
        decode_s = time.perf_counter() - t0
        assert len(decoded) == num_trees and decoded[-1].equals(trees[-1])
        store.close()
        t0 = time.perf_counter()
        ReplayStore(Path(d) / "bytes").close()
        reopen_s = time.perf_counter() - t0
        paths = sorted((Path(d) / "bytes" / "segments").glob("*.arrow"))
        _zero_copy_read(paths)  # warm the page cache, as for pickle's in-memory bytes
        zc_s = min(_zero_copy_read(paths)[0] for _ in range(3))
    blob = pickle.dumps(_as_dicts(trees), protocol=pickle.HIGHEST_PROTOCOL)
    t0 = time.perf_counter()
    rows = pickle.loads(blob)
    pickle_s = time.perf_counter() - t0
    assert len(rows) == stats["nodes"]
    mb = stats["bytes"] / 1e6
    return {
        "nodes": stats["nodes"],
        "trees": num_trees,
        "tokens": stats["tokens"],
        "bytes": stats["bytes"],
        "pickle_bytes": len(blob),
        "write_mb_s": round(mb / write_s, 1),
        "write_reencode_mb_s": round(mb / reencode_s, 1),
        "commit_over_reencode": round(reencode_s / write_s, 2),
        "write_trees_mb_s": round(mb / trees_s, 1),
        "read_zero_copy_mb_s": round(mb / zc_s, 1),
        "pickle_read_mb_s": round(mb / pickle_s, 1),
        "zero_copy_over_pickle": round(pickle_s / zc_s, 1),
        "validate_s": round(validate_s, 3),
        "check_columns_s": round(check_s, 3),
        "decode_trees_s": round(decode_s, 3),
        "reopen_s": round(reopen_s, 3),
        "commits": len(paths),
    }
