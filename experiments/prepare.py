"""A spec's `prepare` section, run once before the grid's runs (its `warm` child): the data files and the
protocol warm start that `make real-demo` makes, the same way and into the same places.

    model_dir = prepare_runs(spec, seed=0, models_dir="runs/models")

1. data: `fanout-wiki` writes train.jsonl, heldout.jsonl and corpus.jsonl into the folder of env.data
   (experiments/grid.py `data_dir`), as `treeopsd data fanout-wiki FOLDER` does; rewritten every time
   (2 s), so the files are always the ones this code makes.
2. warm start: `treeopsd warmstart --steps S --hops A B --out MODELS_DIR/OUT model.path=MODEL` with the
   first row's config (its env.protocol, run.seed = the warm-start seed): the GGUF imported once, the SFT
   cached by its settings (actors/policy/protocol_sft.py), so the demo's model and the grid's are one.
"""

from __future__ import annotations

from pathlib import Path

from experiments.grid import ExperimentSpecError, Spec, data_dir, resolved_config


def make_data(spec: Spec) -> dict[str, int]:
    """The data files of `prepare.data`; returns the manifest's counts."""
    from actors.envs.fanout_wiki import FanoutWikiError, build_fanout_wiki, load_sources, write_fanout_wiki

    folder = data_dir(spec)
    try:
        return write_fanout_wiki(build_fanout_wiki(*load_sources()), folder)
    except (FanoutWikiError, OSError) as e:
        raise ExperimentSpecError(f"{spec.path}: prepare.data = fanout-wiki into {folder}: {e}") from None


def prepare_runs(spec: Spec, seed: int, models_dir: str | Path) -> str:
    """Data (when `prepare.data` is set), then the protocol warm start of `prepare.warmstart.model` into
    models_dir / prepare.warmstart.out; returns that model folder."""
    from actors.policy.protocol_sft import protocol_warmstart
    from runtime.model_setup import ModelPathError, check_model_path

    p = spec.prepare
    if p is None:
        raise ExperimentSpecError(f"{spec.path}: has no prepare section")
    if p.data is not None:
        make_data(spec)
    cfg = resolved_config(spec, spec.rows[0], seed)
    try:
        base = check_model_path(p.model, "prepare.warmstart.model", models_dir=models_dir)
    except ModelPathError as e:
        raise ExperimentSpecError(f"{spec.path}: {e}") from None
    report = protocol_warmstart(
        base,
        Path(models_dir) / p.out,
        cfg.env.protocol,
        steps=p.steps,
        seed=cfg.run.seed,
        enable_thinking=cfg.env.enable_thinking,
        progress=False,
        hops=p.hops,
    )
    return str(report["model_dir"])
