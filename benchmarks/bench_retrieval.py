"""The shared retrieval service against an in-process BM25 index in every sampler.

    treeopsd bench retrieval --json            # 100k generated passages
    treeopsd bench retrieval --json --quick    # 10k

The corpus is generated here (wiki-18 JSONL, no download): titled passages of 40-80 words drawn from a
Zipf-weighted made-up vocabulary of 30k words. The service is `treeopsd retrieve serve` in its own process:
started once to build and save the index (`service_build_s`), then again, loading it (`service_load_s`),
and that second process is the one measured.

Throughput: 8 client threads send single-query requests (a sampler's search turn, topk 3) for a fixed time:
`qps` (queries/s), `p50_ms`, `p99_ms` (request latency); `batched_qps`: the same with 16 queries a request.
Memory, side by side in this run: 4 sampler-like processes that each build the environment a sampler
builds today (`MultiHopQAEnv.from_passages(load_corpus(...))`: its own BM25 index) and run the same 50
searches, against 4 whose environment uses a `RetrievalClient` of the service. RSS is VmRSS from
/proc/<pid>/status after the searches, all 4 alive. `shared_over_inprocess_rss` = (4 client RSS + the
service's RSS, counted once) / (4 in-process RSS); goal <= 0.5. These processes hold only the environment:
a real sampler adds the same policy (torch, model) to both sides.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CLIENTS, SAMPLERS, TOPK = 8, 4, 3
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def make_corpus(path: Path, n: int, seed: int = 0, vocab: int = 30_000) -> list[str]:
    """Writes n passages; returns the vocabulary (words by rank) for the queries."""
    rng = np.random.default_rng(seed)
    words = sorted({"".join(rng.choice(_SYLLABLES, size=rng.integers(2, 5))) for _ in range(vocab * 2)})
    words = [str(w) for w in rng.permutation(words)[:vocab]]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    lengths = rng.integers(40, 81, size=n)
    draws = rng.choice(len(words), size=int(lengths.sum()), p=weights)
    with open(path, "w", encoding="utf-8") as fh:
        start = 0
        for i, length in enumerate(lengths):
            body = " ".join(words[j] for j in draws[start : start + length])
            start += length
            title = " ".join(words[j] for j in draws[start - 2 : start]).title()
            fh.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{body}'}) + "\n")
    return words


def make_queries(words: list[str], n: int, seed: int = 1) -> list[str]:
    """Queries of 3-6 words from the mid-frequency band (ranks 50-5000), as search turns would be."""
    rng = np.random.default_rng(seed)
    band = words[50:5000]
    return [" ".join(rng.choice(band, size=rng.integers(3, 7))) for _ in range(n)]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_service(corpus: Path, index_dir: Path) -> tuple[subprocess.Popen, str, float]:
    """`treeopsd retrieve serve` on a free loopback port; (process, URL, seconds to the ready line)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "launch.cli", "retrieve", "serve", "--corpus", str(corpus)]
    cmd += ["--index-dir", str(index_dir), "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline() if proc.stdout else ""
    match = re.search(r"at (http://\S+)/retrieve", line)
    if match is None:
        proc.kill()
        raise RuntimeError(f"the retrieval service did not start: {line!r}")
    return proc, match.group(1), time.perf_counter() - t0


def stop_service(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def load(url: str, queries: list[str], batch: int, duration_s: float) -> dict[str, float]:
    """CLIENTS threads, each sending `batch` queries a request until `duration_s` is over."""
    from actors.envs.retrieval_client import RetrievalClient

    latencies: list[list[float]] = [[] for _ in range(CLIENTS)]
    deadline = time.perf_counter() + duration_s

    def client(k: int) -> None:
        retriever, i = RetrievalClient(url, retries=0, max_batch=batch), k * 97
        while time.perf_counter() < deadline:
            chunk = [queries[(i + j) % len(queries)] for j in range(batch)]
            t0 = time.perf_counter()
            retriever.search(chunk, TOPK)
            latencies[k].append(time.perf_counter() - t0)
            i += batch

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = np.concatenate([np.asarray(x) for x in latencies]) * 1000
    return {
        "qps": len(lat) * batch / wall,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "requests": float(len(lat)),
    }


def sampler_like(mode: str, corpus: str, url: str, queries: list[str], conn: Any) -> None:
    """One sampler's environment: its own BM25 index ("inprocess") or the service's client ("shared")."""
    from actors.envs.multihop_qa import MultiHopQAEnv, load_corpus

    if mode == "inprocess":
        env = MultiHopQAEnv.from_passages(load_corpus(corpus), topk=TOPK)
    else:
        from actors.envs.retrieval_client import RetrievalClient

        env = MultiHopQAEnv(RetrievalClient(url), topk=TOPK)
    found = sum(env.search(q) != "no results" for q in queries)
    conn.send({"pid": os.getpid(), "found": found})
    conn.recv()  # stay alive until every process of this side is measured


def measure_side(mode: str, corpus: Path, url: str, queries: list[str]) -> list[float]:
    """RSS (MB) of SAMPLERS sampler-like processes of `mode`, all alive when measured."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(SAMPLERS):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=sampler_like, args=(mode, str(corpus), url, queries, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    reports = [p.recv() for p in pipes]
    if any(r["found"] == 0 for r in reports):
        raise RuntimeError(f"{mode}: searches found nothing")
    sizes = [rss_mb(r["pid"]) for r in reports]
    for p in pipes:
        p.send("done")
    for proc in procs:
        proc.join(timeout=60)
    return sizes


def run(args: argparse.Namespace | None = None) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    n, duration = (10_000, 3.0) if quick else (100_000, 10.0)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-retrieval-") as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        queries = make_queries(make_corpus(corpus, n), 2000)
        proc, url, build_s = start_service(corpus, Path(tmp) / "index")
        stop_service(proc)
        proc, url, load_s = start_service(corpus, Path(tmp) / "index")
        try:
            single = load(url, queries, 1, duration)
            batched = load(url, queries, 16, duration)
            inprocess = measure_side("inprocess", corpus, url, queries[:50])
            shared = measure_side("shared", corpus, url, queries[:50])
            service = rss_mb(proc.pid)
        finally:
            stop_service(proc)
    shared_total = sum(shared) + service
    return {
        "passages": n,
        "clients": CLIENTS,
        "topk": TOPK,
        **{k: round(v, 3) for k, v in single.items()},
        "batched_qps": round(batched["qps"], 1),
        "service_build_s": round(build_s, 2),
        "service_load_s": round(load_s, 2),
        "inprocess_rss_mb": [round(x, 1) for x in inprocess],
        "shared_client_rss_mb": [round(x, 1) for x in shared],
        "service_rss_mb": round(service, 1),
        "inprocess_total_mb": round(sum(inprocess), 1),
        "shared_total_mb": round(shared_total, 1),
        "shared_over_inprocess_rss": round(shared_total / sum(inprocess), 3),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    print(json.dumps(run(argparse.Namespace(quick="--quick" in sys.argv)), sort_keys=True))
