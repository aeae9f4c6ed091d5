"""`treeopsd view` on a large store: how soon the list's first page and a tree come back over HTTP.

    treeopsd bench view --json            # 10,000 small trees
    treeopsd bench view --json --quick    # 1,000

A run directory (config.yaml of the defaults, store/) gets `trees` small trees (1–6 turns, as the store tests
write them) in commits of COMMIT_TREES, every other commit credited as well (a credited copy supersedes its
raw one), then a fresh viewer serves it on a loopback port and is asked over HTTP, as the page asks:

    first_page_s      GET /api/trees?limit=50 on the cold server (index empty: it reads the newest segments)
    index_all_s       until the index has read every segment (the background thread)
    filtered_page_s   GET /api/trees?no_signal=1&sort=spread once the index is complete
    tree_s            GET /api/tree/<id>, the first one (cold segment map), and tree_p50_s over 20 more
plus build_s (writing the store), segments, trees. Goals (docs/viewer.md): first page < 2 s, tree < 1 s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from configs.schema import load_config, to_dict
from storage.replay_store import ReplayStore
from system.credit import credit_rollout_tree
from system.tree import RolloutTree, make_node

COMMIT_TREES = 20


def small_tree(i: int) -> RolloutTree:
    """Tree i: 1–6 turns in a random shape, 0–11 tokens a turn, leaf rewards 0 or 1."""
    rng = np.random.default_rng(i)
    turns = int(rng.integers(1, 7))
    parents = [-1, 0] + [int(rng.integers(0, k)) for k in range(2, turns + 1)]
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    nodes = [make_node(0, -1, 0, obs_tokens=rng.integers(0, 1000, int(rng.integers(1, 8))))]
    for j in range(1, turns + 1):
        n = int(rng.integers(0, 12))
        lp = -rng.exponential(1.0, n)
        reward = None if j in parents else float(rng.integers(0, 2))
        obs = rng.integers(0, 1000, int(rng.integers(0, 4)))
        nodes.append(make_node(j, parents[j], depth[j], rng.integers(0, 1000, n), None, lp, obs, 0, reward))
    return RolloutTree.build(f"t{i}", nodes, prompt_id=f"p{i % 5}", meta={"task_id": f"task-{i % 50}"})


def write_run(root: Path, trees: int) -> int:
    """A run directory with `trees` trees; returns the number of segments."""
    cfg = load_config(overrides=[f"run.run_dir={root}"])
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    with ReplayStore(root / "store", validate="structure") as store:
        for k, start in enumerate(range(0, trees, COMMIT_TREES)):
            batch = [small_tree(i) for i in range(start, min(start + COMMIT_TREES, trees))]
            store.put_raw(batch)
            if k % 2:
                store.put_credited([credit_rollout_tree(t, cfg.algo) for t in batch])
        return store.stats()["segments"]["total"]


def _get(url: str) -> tuple[float, Any]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        body = json.loads(r.read())
    return time.perf_counter() - t0, body


def measure(run_dir: Path) -> dict[str, Any]:
    """The figures of the module docstring for an existing run directory."""
    from viewer.app import RunView
    from viewer.server import ViewServer

    view = RunView.open(run_dir)
    server = ViewServer(view.handlers(), "127.0.0.1", 0)
    server.start()
    try:
        base = server.url
        t0 = time.perf_counter()
        view.start()
        first_s, page = _get(base + "api/trees?limit=50")
        while not view.index.complete():
            time.sleep(0.01)
        index_s = time.perf_counter() - t0
        filtered_s, filtered = _get(base + "api/trees?no_signal=1&sort=spread&limit=50")
        ids = [r["id"] for r in _get(base + "api/trees?limit=21&sort=task")[1]["rows"]]
        tree_s, tree = _get(base + f"api/tree/{ids[0]}")
        more = [_get(base + f"api/tree/{t}")[0] for t in ids[1:]]
        return {
            "first_page_s": round(first_s, 4),
            "first_page_rows": len(page["rows"]),
            "index_all_s": round(index_s, 3),
            "filtered_page_s": round(filtered_s, 4),
            "filtered_total": filtered["total"],
            "tree_s": round(tree_s, 4),
            "tree_p50_s": round(float(np.median(more)), 4),
            "tree_nodes": len(tree.get("nodes", [])),
            "trees_listed": _get(base + "api/trees?limit=1")[1]["total"],
        }
    finally:
        server.close()
        view.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    trees = 1000 if args.quick else 10_000
    with tempfile.TemporaryDirectory(prefix="bench-view-") as tmp:
        t0 = time.perf_counter()
        segments = write_run(Path(tmp) / "run", trees)
        build_s = time.perf_counter() - t0
        out = measure(Path(tmp) / "run")
    return {"trees": trees, "segments": segments, "build_s": round(build_s, 2), **out}


def render(r: dict[str, Any]) -> str:
    """benchmarks/results/view.md (docs/viewer.md shows it): the figures beside their goals."""
    import os
    import platform

    return (
        "# treeopsd view on a large store\n\n"
        f"`treeopsd bench view --json --out benchmarks/results/view.json`: {r['trees']:,} small trees in "
        f"{r['segments']} segments (written in {r['build_s']} s), a cold server, every figure over HTTP "
        f"({os.cpu_count()} CPUs, Python {platform.python_version()}).\n\n"
        "| figure | measured | goal |\n|---|---:|---|\n"
        f"| the list's first page (50 rows), index empty | {r['first_page_s']} s | < 2 s |\n"
        f"| one tree, first (cold) | {r['tree_s']} s | < 1 s |\n"
        f"| one tree, median of 20 more | {r['tree_p50_s']} s | < 1 s |\n"
        f"| every segment indexed (background) | {r['index_all_s']} s | |\n"
        f"| a filtered and sorted page (no signal, by spread) once indexed | {r['filtered_page_s']} s | |\n"
    )
