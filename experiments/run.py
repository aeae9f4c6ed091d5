"""One run of the experiment grid, in its own process: warm-start, train (in-process, synchronous), evaluate.

Each run writes `result.json` into its folder last, atomically; a folder with one is done, so an interrupted
grid resumes where it stopped. Training uses `runtime/local.py` (the same sampler, backup and learner code
as the Ray topology, one process, one thread): every row gets the same B prompts per step with no policy lag,
so rows differ only in their algorithm settings.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from runtime.lean_imports import hide_unused_optional_packages

TRAINING_CURVES = ("reward/mean", "learner/loss", "learner/grad_norm", "learner/max_abs_s", "tree/leaves")
TRAINING_CURVES += ("tree/sampled_tokens",)
STALENESS_CURVES = (
    "weights/version_lag",
    "mismatch/k3",
    "correction/weight_mean",
    "correction/clipped_token_frac",
    "correction/turn_kl",
    "correction/turn_ess",
    "store/lag_limit",
)
CURVE_KEYS = (*TRAINING_CURVES, *STALENESS_CURVES, "tree/truncated_frac")
# What the runner imposes on every run (documented in docs/results.md).
RUN_SETTINGS = (
    "run.mode=sync",
    "store.eta=0",
    "sampler.num_samplers=1",
    "logging.progress=false",
    "logging.learner_turns=false",  # `treeopsd view`'s per-turn record: hundreds of runs need none
    "learner.checkpoint_every=1000000",  # the run saves its final weights itself
)


def _threads() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()  # 40 runs' load bars would bury the grid's progress
    transformers.utils.logging.set_verbosity_error()


def warm_start(spec_path: str, quick: bool, seed: int, models_dir: str, row_name: str | None = None) -> str:
    """The seed's warm-started tiny model (cached in models_dir) for `row_name`'s settings (default: the
    first row's), or the config's model.path, or with a `prepare` section its data and protocol warm start
    (experiments/prepare.py)."""
    _threads()
    from experiments.grid import load_spec, resolved_config
    from runtime.model_setup import resolve_model

    spec = load_spec(spec_path, quick)
    if spec.prepare is not None:
        from experiments.prepare import prepare_runs

        return prepare_runs(spec, seed, models_dir)
    row = next((r for r in spec.rows if r.name == row_name), spec.rows[0])
    return resolve_model(resolved_config(spec, row, seed), progress=False, models_dir=models_dir)


def run_one(
    spec_path: str, quick: bool, run: dict[str, Any], model_path: str, run_dir: str
) -> dict[str, Any]:
    """Train (unless the row is evaluation-only) and evaluate; returns and writes result.json."""
    _threads()
    from actors.sampler_setup import build_env, load_split
    from experiments.evaluation import evaluate, take
    from experiments.grid import load_spec, resolved_config
    from experiments.provenance import write_json
    from runtime.local import build_local_run
    from runtime.model_setup import load_tokenizer

    spec = load_spec(spec_path, quick)
    row = next(r for r in spec.rows if r.name == run["rows"][0])
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    extra = (
        f"run.steps={spec.steps}",
        f"run.run_dir={folder / 'run'}",
        f"model.path={model_path}",
        f"run.eval_tasks={spec.eval_tasks}",
        *RUN_SETTINGS,
    )
    cfg = resolved_config(spec, row, run["seed"], extra)
    result: dict[str, Any] = {**run, "expected_cost": cfg.algo.expected_cost, "steps": 0, "curves": {}}
    evaluated, t0 = model_path, time.perf_counter()
    if run["train"]:
        local = build_local_run(cfg, model_path)
        curves: dict[str, list[float]] = {k: [] for k in CURVE_KEYS}
        try:
            for _ in range(spec.steps):
                metrics = local.step()
                for k in CURVE_KEYS:
                    curves[k].append(float(metrics.get(k, float("nan"))))
            tok = load_tokenizer(model_path)
            evaluated = str(local.learner.save(folder / "run", spec.steps, {}, tok))
        finally:
            local.close()
        result.update(steps=spec.steps, curves=curves)
    result["train_s"] = round(time.perf_counter() - t0, 1)
    env = build_env(cfg)
    tasks = take(load_split(cfg, "eval", env), spec.eval_tasks)
    result["eval"] = evaluate(cfg, evaluated, tasks, env, batch=64, samples=spec.samples)
    result["model"] = evaluated
    write_json(folder / "result.json", result)
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m experiments.run warm SPEC QUICK SEED MODELS_DIR [ROW]` prints the model path;
    `... run SPEC QUICK RUN_JSON MODEL_PATH RUN_DIR` writes RUN_DIR/result.json. JSON in, JSON out."""
    import sys

    hide_unused_optional_packages()
    args = sys.argv[1:] if argv is None else argv
    if len(args) in (5, 6) and args[0] == "warm":
        row = args[5] if len(args) == 6 else None
        print(json.dumps({"model": warm_start(args[1], args[2] == "1", int(args[3]), args[4], row)}))
        return 0
    if len(args) == 6 and args[0] == "run":
        run_one(args[1], args[2] == "1", json.loads(args[3]), args[4], args[5])
        return 0
    print(main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
