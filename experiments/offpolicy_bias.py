"""The first-step gradient bias of each off-policy mode (`make offpolicy-table`, part 1; docs/algorithm.md
§11.1): how far the gradient a step takes from μ's trees lands from the on-policy gradient of π_prox.

    python -m experiments.offpolicy_bias configs/offpolicy_table.yaml --out benchmarks/results

One warm-started model is π_prox. Trees come from two samplers of it: μ at `sampler.temperature` (above the
learner's `learner.temperature`: a known mismatch) and π_prox itself at the learner's temperature (the
on-policy reference). Each mode's gradient is the learner's own first mini-batch gradient (`Learner.step`
with an optimizer that records instead of stepping), rescaled to a per-tree mean. With batches b = 1..n of
each sampler (independent), D_b = ḡ_mode(μ batch b) − ḡ_on(π batch b) and

    bias² = ‖E ḡ_mode − E ḡ_on‖² ≈ (‖Σ_b D_b‖² − Σ_b ‖D_b‖²) / (n (n − 1))      (unbiased: no noise floor)

reported relative to ‖E ḡ_on‖² (estimated the same way), with jackknife standard errors over b. Modes share
the batches, so "bias below none's" is a paired difference with its own jackknife error. The per-tree
variance each weight costs is tr Cov of the per-tree gradient, relative to none's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml


def unbiased_sq_norm(vectors: np.ndarray) -> float:
    """‖E v‖² from n independent rows v_b: (‖Σ v‖² − Σ ‖v_b‖²) / (n (n − 1))."""
    n = len(vectors)
    total = vectors.sum(0)
    return float((total @ total - (vectors * vectors).sum()) / (n * (n - 1)))


def jackknife(stat, rows: Sequence[np.ndarray]) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(stat over all rows, its jackknife standard error over the rows' leading index)."""
    n = len(rows[0])
    full = stat(*rows)
    loo = np.array([stat(*(np.delete(r, b, axis=0) for r in rows)) for b in range(n)])
    return full, float(math.sqrt((n - 1) / n * ((loo - loo.mean()) ** 2).sum()))


def bias_table(on_policy: np.ndarray, modes: dict[str, np.ndarray], per_batch: int) -> list[dict[str, Any]]:
    """Per mode: relative squared bias ± se, relative bias, the paired difference to `none` (the first mode
    whose name says none, else the first mode) ± se, and the per-tree variance relative to that mode's.

    on_policy [n, P] and every modes[m] [n, P]: per-batch mean gradients (batch b of each independent)."""
    scale = unbiased_sq_norm(on_policy)
    base = next((m for m in modes if "none" in m), next(iter(modes)))
    var_base = _tree_variance(modes[base], per_batch)
    out = []
    for name, grads in modes.items():
        sq, sq_se = jackknife(lambda g, o: unbiased_sq_norm(g - o), [grads, on_policy])
        diff, diff_se = jackknife(
            lambda g, b, o: unbiased_sq_norm(b - o) - unbiased_sq_norm(g - o), [grads, modes[base], on_policy]
        )
        out.append(
            {
                "mode": name,
                "rel_sq_bias": sq / scale,
                "rel_sq_bias_se": sq_se / scale,
                "rel_bias": math.sqrt(max(sq, 0.0) / scale),
                "below_base": diff / scale,
                "below_base_se": diff_se / scale,
                "base": base,
                "rel_variance": _tree_variance(grads, per_batch) / var_base,
            }
        )
    return out


def _tree_variance(grads: np.ndarray, per_batch: int) -> float:
    """tr Cov of one tree's gradient: the batch means' spread times the trees per batch."""
    centred = grads - grads.mean(0)
    return float((centred * centred).sum() / (len(grads) - 1) * per_batch)


# ---- the wiring: trees from a sampler, gradients from the learner ------------------------------------------
def collect_trees(cfg: Any, model_path: str, n: int, run_dir: Path) -> list[Any]:
    """n credited trees from one in-process sampler of `model_path` at `cfg.sampler.*` (runtime/local.py)."""
    from runtime.local import build_local_run

    # the store admits one batch per learner version, and the version never moves here: one batch of all n
    run_cfg = cfg.model_copy(
        update={
            "run": cfg.run.model_copy(update={"run_dir": str(run_dir)}),
            "learner": cfg.learner.model_copy(update={"batch_trees": n}),
        }
    )
    run = build_local_run(run_cfg, model_path)
    try:
        for _ in range(100 * n):
            run.samplers[0].sample_and_commit(cfg.sampler.prompts_per_request)
            run.backup.run_once()
            if (trees := run.store.take_batch(n)) is not None:
                return trees
    finally:
        run.close()
    raise RuntimeError(f"{n} credited trees not sampled in {100 * n} rounds")


def batch_gradients(cfg: Any, model: Any, trees: Sequence[Any], per_batch: int) -> tuple[np.ndarray, float]:
    """Per batch of `per_batch` trees, the learner's gradient as a per-tree mean ([n, P] float64), and the
    mean `mismatch/k3` the step logged (nan where it logs none)."""
    from learner.learner import Learner
    from learner.methods import METHODS

    recorder = GradientRecorder(model.parameters())
    learner = Learner(model, cfg, optimizer=recorder)
    rows, k3 = [], []
    for start in range(0, len(trees) - per_batch + 1, per_batch):
        batch = list(trees[start : start + per_batch])
        recorder.grads.clear()
        stats = learner.step(batch)
        z = METHODS[cfg.algo.method].normalizer(batch, None)  # the step's Z: back to a per-tree sum
        grad = recorder.grads[0] if recorder.grads else torch.zeros(recorder.size, dtype=torch.float64)
        rows.append((grad * z / len(batch)).numpy())
        k3.append(stats.get("mismatch/k3", math.nan))
    return np.stack(rows), float(np.nanmean(k3)) if not all(map(math.isnan, k3)) else math.nan


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer that records the flattened gradient at each `step` and never moves the weights."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.0})
        self.grads: list[torch.Tensor] = []
        self.size = sum(p.numel() for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double() for p in params]
        self.grads.append(torch.cat(grads))


# ---- the command -------------------------------------------------------------------------------------------
GRADIENT_SETTINGS = ("learner.minibatches=1", "learner.grad_clip=0", "learner.epochs=1")


def measure_method(spec: Any, section: dict[str, Any], model_path: str, work: Path) -> dict[str, Any]:
    """One method's trees (μ and on-policy), its modes' gradients and their bias table."""
    from transformers import AutoModelForCausalLM

    from experiments.grid import resolved_config
    from experiments.run import RUN_SETTINGS

    per_batch, n = int(section["trees_per_batch"]), int(section["batches"])
    sets = [f"{k}={v}" for k, v in section["set"].items()]
    extra = (
        *RUN_SETTINGS,
        f"model.path={model_path}",
        f"learner.batch_trees={per_batch}",
        *GRADIENT_SETTINGS,
    )
    row = spec.rows[0]
    row = dataclasses.replace(row, overrides=(*row.overrides, *sets))
    cfg = resolved_config(spec, row, spec.model_seed(0), extra)
    on_t = cfg.learner.temperature or cfg.sampler.temperature
    cfg_on = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"temperature": on_t})})
    trees_mu = collect_trees(cfg, model_path, n * per_batch, work / "mu")
    trees_on = collect_trees(cfg_on, model_path, n * per_batch, work / "on")
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True)
    reference = {"proximal": "behavior", "rollout_correction": "none"}  # μ = π_prox here: on-policy
    on, _ = batch_gradients(_with_algo(cfg_on, reference), model, trees_on, per_batch)
    grads, k3 = {}, {}
    for mode in section["modes"]:
        grads[mode["name"]], k3[mode["name"]] = batch_gradients(
            _with_algo(cfg, mode["set"]), model, trees_mu, per_batch
        )
    rows = bias_table(on, grads, per_batch)
    for r in rows:
        r["mismatch_k3"] = k3[r["mode"]]
    return {"method": cfg.algo.method, "temperatures": [cfg.sampler.temperature, on_t], "rows": rows}


def _with_algo(cfg: Any, values: dict[str, Any]) -> Any:
    """`cfg` with algo fields set *without* validation: the modes the config refuses are measured too (the
    table is the evidence for refusing them)."""
    fields = {k.removeprefix("algo."): v for k, v in values.items()}
    return cfg.model_copy(update={"algo": cfg.algo.model_copy(update=fields)})


def render(results: dict[str, Any]) -> str:
    lines = [
        "# offpolicy_bias",
        "",
        f"`python -m experiments.offpolicy_bias {results['spec']}` — first-step gradient of each mode on μ's "
        "trees against the on-policy gradient of π_prox (experiments/offpolicy_bias.py). Commit "
        f"{results['commit']}, {results['date']}, {results['cpus']} CPUs ({results['cpu']}), "
        f"{results['wall_s'] / 60:.1f} min wall.",
        "",
        "| method | mode | μ vs π_prox k3 | relative bias ‖E g − g_on‖ / ‖g_on‖ | relative bias² "
        "| bias² below none's | per-tree variance vs none |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for m in results["methods"]:
        t_mu, t_on = m["temperatures"]
        for r in m["rows"]:
            k3 = "—" if math.isnan(r["mismatch_k3"]) else f"{r['mismatch_k3']:.3f}"
            cells = [
                f"{m['method']} (μ at T={t_mu:g}, π_prox at T={t_on:g}, {m['trees']} trees each)",
                r["mode"],
                k3,
                f"{r['rel_bias']:.3f}",
                f"{r['rel_sq_bias']:.4f} ± {r['rel_sq_bias_se']:.4f}",
                f"{r['below_base']:+.4f} ± {r['below_base_se']:.4f}",
                f"{r['rel_variance']:.2f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import time

    from experiments import provenance
    from experiments.grid import ExperimentSpecError, load_spec
    from experiments.run import warm_start

    parser = argparse.ArgumentParser(prog="python -m experiments.offpolicy_bias")
    parser.add_argument("spec")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--models-dir", default="runs/models")
    parser.add_argument("--work", default="runs/offpolicy_bias")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec, False)
        sections = yaml.safe_load(Path(args.spec).read_text())["gradient_bias"]
    except (ExperimentSpecError, KeyError, TypeError) as e:
        print(f"offpolicy_bias: {args.spec}: no usable gradient_bias section ({e})", file=sys.stderr)
        return 2
    t0 = time.time()
    model_path = warm_start(args.spec, False, spec.model_seed(0), args.models_dir)
    methods = []
    for name, section in sections.items():
        result = measure_method(spec, section, model_path, Path(args.work) / name)
        methods.append({**result, "trees": int(section["batches"]) * int(section["trees_per_batch"])})
    results = {
        "spec": args.spec,
        "commit": provenance.commit(),
        "date": provenance.now(),
        "cpu": provenance.cpu_model(),
        "cpus": os.cpu_count(),
        "wall_s": round(time.time() - t0, 1),
        "methods": methods,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    provenance.write_json(out / "offpolicy_bias.json", results)
    (out / "offpolicy_bias.md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
