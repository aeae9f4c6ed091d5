"""`treeopsd bench learner_ranks --json`: the sharded learner (learner.ranks, docs/design.md §12) on the CPU.

    dp2_over_dp1             learner tokens/s of 2 ranks (FSDP2, gloo, 1 torch thread each) over 1 rank
                             (the plain Learner, 1 thread) on the same 32 trees (goal ≥ 1.7, limit 2.0)
    fsdp2_state_bytes_ratio  per-rank parameter + gradient + AdamW bytes with 2 ranks over 1 rank (the
                             largest rank; goal ≤ 0.55, limit 0.5)
    dp2_over_dp1_cpu         the same ratio from process CPU seconds (the busiest rank's): what dedicated
                             cores would give if waiting cost nothing, for a machine busy with other work
    dp1_tokens_per_s, dp2_tokens_per_s, dp1_step_s, dp2_step_s, state_bytes_dp1, state_bytes_dp2, cpus

Step times are wall seconds (ranks run at once, so CPU time would hide the parallelism), the minimum over
repetitions after a warm-up step, each repetition started by a barrier and ended when the slowest rank
ends; on a machine with fewer free cores than ranks, dp2_over_dp1 measures the contention, not FSDP2.

Every rank is a fresh process, `python -m benchmarks.learner_ranks SPEC RANK` (`run_ranks`): the spec is
JSON, the trees Arrow IPC, the model an HF folder, each rank's result a JSON file and rank 0's final
weights a safetensors file; nothing is pickled. tests/component/test_sharded_distributed.py runs the same
processes to compare 2 ranks with 1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.lean_imports import hide_unused_optional_packages

RANK_TIMEOUT_S = 900.0  # one rank process's whole run (model load, warm-up, repetitions)
# Trees per learner step: a rollout batch of the size users train with (32-256), not a toy 8. Each mini-batch
# costs the ranks a fixed exchange (FSDP2's all-gather and reduce-scatter over gloo) and waits for the rank
# with the most tokens; with 8 trees, 2 per rank per mini-batch, those two would be most of what is measured.
BENCH_TREES = 32


# ---- the parent: inputs, processes, results -----------------------------------------------------------
def write_inputs(folder: str | Path, trees: list, model: Any = None, tokenizer: Any = None) -> Path:
    """`folder/trees.arrow` and (given a model) `folder/model` (HF), what every rank process reads."""
    from storage.tree_codec import encode_ipc

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trees.arrow").write_bytes(encode_ipc(trees))
    if model is not None:
        model.save_pretrained(folder / "model", safe_serialization=True)
        tokenizer.save_pretrained(folder / "model")
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    folder: str | Path,
    world: int,
    cfg: dict,
    *,
    model_dir: str | Path | None = None,
    steps: int = 1,
    warmup: int = 0,
    first_batch: int = 0,
    restore: bool = False,
    save: bool = False,
    save_at: tuple[int, ...] = (),
    dump: bool = False,
    tag: str = "run",
) -> list[dict]:
    """Runs `world` rank processes on `folder`'s trees (batches of learner.batch_trees in order; step k takes
    batch first_batch + k, mod the number of batches) and returns each rank's result (`_rank_main`).
    world = 1 is the plain `Learner` without a process group. restore: resume from cfg's run_dir first;
    save: a checkpoint after the last step; save_at: after these (timed) steps too; dump: after each timed
    step k, rank 0 writes the full fp32 state dict (state{k}.safetensors) and the published version
    (published{k}.safetensors, its header meta in published{k}.json). A rank that fails fails the call with
    its stderr."""
    folder = Path(folder)
    out = folder / tag
    out.mkdir(parents=True, exist_ok=True)
    spec = {"world": world, "port": _free_port(), "cfg": cfg, "steps": steps, "warmup": warmup}
    spec["first_batch"] = first_batch
    spec.update(model_dir=str(model_dir or folder / "model"), trees=str(folder / "trees.arrow"))
    spec.update(restore=restore, save=save, save_at=list(save_at), dump=dump, out=str(out))
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "benchmarks.learner_ranks", str(out / "spec.json")]
    procs = [
        subprocess.Popen([*cmd, str(r)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for r in range(world)
    ]
    errors = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"rank {rank} exited {proc.returncode}: {err.decode(errors='replace')[-3000:]}")
    if errors:
        raise RuntimeError("\n".join(errors))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# ---- one rank process -------------------------------------------------------------------------------------
def _learner(spec: dict, rank: int) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from configs.schema import parse_config
    from learner.device import learner_device
    from learner.learner import Learner

    cfg = parse_config(spec["cfg"])
    torch.manual_seed(cfg.run.seed)
    folder = spec["model_dir"]
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if spec["world"] == 1:
        return Learner(model, cfg, tokenizer=tokenizer)
    from learner.distributed import init_process_group
    from learner.sharded import sharded_learner

    timeout = cfg.learner.collective_timeout_s
    init_process_group(rank, spec["world"], "127.0.0.1", spec["port"], timeout, learner_device(cfg))
    return sharded_learner(model, cfg, tokenizer=tokenizer)


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def state_bytes(learner: Any) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes (local shards of DTensors)."""
    from learner.distributed import local_bytes

    params = list(learner.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    optim = [v for s in learner.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": local_bytes(params), "grads": local_bytes(grads), "optimizer": local_bytes(optim)}


def _rank_main(spec_path: str, rank: int) -> None:
    """One rank: build, (restore), warm-up steps, timed steps, (save); writes rank{r}.json and, on rank 0,
    weights.safetensors (the full fp32 parameters after the last step)."""
    from safetensors.torch import save_file

    from storage.tree_codec import decode_ipc

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    world, out = spec["world"], Path(spec["out"])
    learner = _learner(spec, rank)
    restored = learner.restore(spec["cfg"]["run"]["run_dir"]) if spec["restore"] else None
    trees = decode_ipc(Path(spec["trees"]).read_bytes(), "bench trees")
    b = int(spec["cfg"]["learner"]["batch_trees"])
    batches = [trees[i : i + b] for i in range(0, len(trees), b)]
    stats, wall, cpu = [], [], []
    for k in range(spec["warmup"] + spec["steps"]):
        _barrier(world)
        t0, c0 = time.perf_counter(), time.process_time()
        st = learner.step(batches[(spec["first_batch"] + k) % len(batches)])
        _barrier(world)  # the repetition ends when the slowest rank ends
        if k >= spec["warmup"]:
            stats.append(st)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)  # every thread of this rank: torch's and gloo's
            _after_step(learner, spec, rank, len(stats))
    result = {"rank": rank, "stats": stats, "wall_s": wall, "cpu_s": cpu, "state_bytes": state_bytes(learner)}
    result["restored_step"] = None if restored is None else restored.step
    if spec["save"]:
        learner.save(spec["cfg"]["run"]["run_dir"], extra={"watermark": learner.version})
    weights = {n: t.float().contiguous() for n, t in learner.named_weights().items()}  # a collective
    if rank == 0:
        save_file(weights, str(out / "weights.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # no rank tears down its end of the group while another is still in a collective
        dist.destroy_process_group()


def _after_step(learner: Any, spec: dict, rank: int, done: int) -> None:
    """The spec's checkpoint after `done` timed steps (save_at) and dumps (dump; see `run_ranks`)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from learner.lora import published_weights

    if done in spec.get("save_at", []):
        learner.save(spec["cfg"]["run"]["run_dir"], extra={"watermark": learner.version})
    if not spec.get("dump"):
        return
    if spec["world"] > 1:  # a collective
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(learner.model, options=options)
    else:
        state = learner.model.state_dict()
    published = published_weights(learner.model, learner.cfg, learner.named_weights)  # a collective too
    if rank == 0:
        out = Path(spec["out"])
        save_file({k: v.float().clone() for k, v in state.items()}, str(out / f"state{done}.safetensors"))
        save_file({k: v.clone() for k, v in published.items()}, str(out / f"published{done}.safetensors"))
        (out / f"published{done}.json").write_text(json.dumps(getattr(published, "meta", {})))


# ---- the benchmark ----------------------------------------------------------------------------------------
def _inputs(folder: Path, quick: bool) -> tuple[int, int]:
    """The model (hidden 128 / 4 layers; quick: 64 / 2) and BENCH_TREES credited (4,2) trees (quick: 8);
    (trees, tokens)."""
    from actors.policy.tiny_model import build_tiny_model
    from benchmarks.workloads import bench_tokenizer, random_rollout_tree
    from configs.schema import parse_config
    from system.credit import credit_rollout_tree

    tok = bench_tokenizer()
    shape = (64, 2, 2, 1) if quick else (128, 4, 4, 2)
    model = build_tiny_model(tok, *shape, max_positions=4096)
    model.config._attn_implementation = "sdpa"
    rng = np.random.default_rng(0)
    algo = parse_config({}).algo
    n = 8 if quick else BENCH_TREES
    trees = [credit_rollout_tree(random_rollout_tree(rng, f"t{i}", len(tok)), algo) for i in range(n)]
    write_inputs(folder, trees, model, tok)
    return len(trees), int(sum(t.num_tokens for t in trees))


def run(args: Any) -> dict:
    quick = bool(getattr(args, "quick", False))
    reps = 1 if quick else 4
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        folder = Path(tmp)
        n_trees, _ = _inputs(folder, quick)
        results: dict[int, list[dict]] = {}
        for world in (1, 2):
            cfg = {
                "run": {"run_dir": str(folder / f"run{world}"), "seed": 0},
                "learner": {"batch_trees": n_trees, "minibatches": 2, "lr": 1e-4, "ranks": world},
            }
            results[world] = run_ranks(folder, world, cfg, steps=reps, warmup=1, tag=f"dp{world}")
    step = {w: min(max(r["wall_s"][i] for r in rs) for i in range(reps)) for w, rs in results.items()}
    cpu = {w: min(max(r["cpu_s"][i] for r in rs) for i in range(reps)) for w, rs in results.items()}
    tokens = {w: rs[0]["stats"][0]["learner/tokens"] for w, rs in results.items()}
    tps = {w: tokens[w] / step[w] for w in step}
    state = {w: max(sum(r["state_bytes"].values()) for r in rs) for w, rs in results.items()}
    return {
        "dp2_over_dp1": round(tps[2] / tps[1], 3),
        "fsdp2_state_bytes_ratio": round(state[2] / state[1], 4),
        "dp2_over_dp1_cpu": round(cpu[1] / cpu[2], 3),  # same tokens per step: the time ratio
        "dp1_tokens_per_s": round(tps[1], 1),
        "dp2_tokens_per_s": round(tps[2], 1),
        "dp1_step_s": round(step[1], 4),
        "dp2_step_s": round(step[2], 4),
        "state_bytes_dp1": state[1],
        "state_bytes_dp2": state[2],
        "tokens_per_step": tokens[1],
        "reps": reps,
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


if __name__ == "__main__":
    hide_unused_optional_packages()
    _rank_main(sys.argv[1], int(sys.argv[2]))
    # Everything this rank reports is in its files by now. Exit without the interpreter's finalization:
    # the FSDP model and its mesh still hold the gloo process group, whose worker threads, destroyed during
    # finalization, can end the process with SIGABRT ("terminate called without an active exception",
    # pytorch#190489), which failed a CI run after the rank had written its result.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
