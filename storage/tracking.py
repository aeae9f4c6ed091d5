"""Experiment trackers beside tensorboard: Weights & Biases and MLflow, off by default (`logging.wandb`,
`logging.mlflow`), each receiving exactly the scalars and steps tensorboard receives.

    sink = run_sink(cfg, run_dir)      # tensorboard (or nothing) plus the trackers the config turns on
    sink.log({"learner/loss": 0.3}, step=7); sink.close()

* wandb: `wandb.init(project=logging.wandb_project, name=run.name, dir=RUN_DIR, config=<the whole config>)`;
  where it sends the run follows wandb's own settings (`WANDB_MODE=offline` keeps it in RUN_DIR/wandb,
  `wandb sync` uploads it later). Histograms go as `wandb.Histogram`.
* MLflow: a run named run.name in the experiment `logging.mlflow_experiment` at `logging.mlflow_uri` (a
  tracking server's http(s) URL; unset: RUN_DIR/mlruns, MLflow's file store, which MLflow 3 keeps only
  behind `MLFLOW_ALLOW_FILE_STORE`, set here for that local folder). The config's
  keys are logged as params (flattened, `section.key`). Histograms are logged as their mean (MLflow has
  scalars only), under `<key>/mean`.

Non-finite values are skipped, as tensorboard's sink does. The packages are optional imports: a run that
turns a tracker on without its package fails at start, naming the package and the key.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from storage.metrics import NullSink, TensorboardSink


class WandbSink:
    def __init__(self, run_dir: Path, name: str, project: str, config: Mapping[str, Any]) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=project, name=name, dir=str(run_dir), config=dict(config))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        if finite:
            self._run.log(finite, step=step)

    def histogram(self, key: str, values: Sequence[float], step: int) -> None:
        if len(values):
            self._run.log({key: self._wandb.Histogram(list(values))}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    def __init__(self, run_dir: Path, name: str, experiment: str, uri: str | None, params: Mapping[str, Any]):
        from mlflow import MlflowClient

        if uri is None:
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # module docstring
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        self._log_params(params)

    def _log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = [Param(k, str(v)[:6000]) for k, v in _flatten(params).items()]
        for i in range(0, len(flat), 100):  # MLflow's batch limit is 100 params
            self.client.log_batch(self.run_id, params=flat[i : i + 100])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, step) for k, v in metrics.items() if math.isfinite(float(v))]
        for i in range(0, len(rows), 1000):  # MLflow's batch limit is 1000 metrics
            self.client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def histogram(self, key: str, values: Sequence[float], step: int) -> None:
        if len(values):
            self.log({f"{key}/mean": sum(values) / len(values)}, step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class FanoutSink:
    """Every call to each of `sinks`, in order."""

    def __init__(self, sinks: Sequence[Any]) -> None:
        self.sinks = list(sinks)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for s in self.sinks:
            s.log(metrics, step)

    def histogram(self, key: str, values: Sequence[float], step: int) -> None:
        for s in self.sinks:
            s.histogram(key, values, step)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def check_trackers(logging: Any) -> None:
    """Fails before a run starts when a tracker is on and its package is missing (one line)."""
    import importlib.util

    for package in ("wandb", "mlflow"):
        if getattr(logging, package) and importlib.util.find_spec(package) is None:
            key = f"logging.{package}"
            raise ValueError(f"{key} = true needs the `{package}` package (pip install {package})")


def run_sink(cfg: Any, run_dir: Path) -> Any:
    """Tensorboard (unless `logging.tensorboard` is off) and the trackers `cfg.logging` turns on."""
    from configs.schema import to_dict

    lg = cfg.logging
    check_trackers(lg)
    sinks: list[Any] = [TensorboardSink(run_dir / "tb")] if lg.tensorboard else []
    if lg.wandb:
        sinks.append(WandbSink(run_dir, cfg.run.name, lg.wandb_project, to_dict(cfg)))
    if lg.mlflow:
        sinks.append(MlflowSink(run_dir, cfg.run.name, lg.mlflow_experiment, lg.mlflow_uri, to_dict(cfg)))
    if not sinks:
        return NullSink()
    return sinks[0] if len(sinks) == 1 else FanoutSink(sinks)
