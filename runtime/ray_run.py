"""A training run on Ray, start to end: what `treeopsd train` (and `treeopsd demo`) wrap around the driver.

    with ray_training(cfg, model_path, resume) as driver:     # Ray up, the roles placed and started
        summary = driver.finish(driver.run(cfg.run.steps))    # the tick loop; the final checkpoint
                                                              # on exit: every role stopped, Ray left up

Before the roles start: what a SIGKILLed driver of this run left behind is reaped (runtime/leftovers.py),
Ray is joined or started (runtime/topology.py:init_ray), the metrics sink opened and the tensorboard command
printed. The first SIGINT/SIGTERM asks the driver to stop after its learner step (runtime/signals.py); a
second one raises `Abort`, a failure of the run like any other: the fault tolerance's decision (StopNow)
kills every actor of the run at once (what they wrote is atomic).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from runtime.driver import Driver
from runtime.fault_tolerance import FaultTolerance
from runtime.leftovers import reap_dead_run, record_local_ray
from runtime.roles import Roles
from runtime.signals import Abort, GracefulStop
from runtime.topology import init_ray
from storage.tracking import run_sink


@contextmanager
def ray_training(cfg: Any, model_path: str, resume: bool = False) -> Iterator[Driver]:
    """A driver over the run's roles on Ray (module docstring); progress per `logging.progress`."""
    run_dir = Path(cfg.run.run_dir)
    reap_dead_run(run_dir)
    init_ray(cfg)
    sink = run_sink(cfg, run_dir)
    if cfg.logging.tensorboard:
        tb = (run_dir / "tb").resolve()
        print(f"watch it: tensorboard --logdir {tb} --host 127.0.0.1", file=sys.stderr)
    with GracefulStop() as stop:  # after init_ray: replaces Ray's SIGTERM handler
        topo = Roles.start(cfg, model_path, resume)
        ft, stopped_now = FaultTolerance(cfg, topo), False
        record_local_ray(run_dir)
        try:
            with tqdm(
                total=cfg.run.steps, desc=cfg.run.name, unit="step", disable=not cfg.logging.progress
            ) as bar:
                driver = Driver(cfg, topo, sink, bar, stop=stop, ft=ft)
                bar.update(driver.step)
                yield driver
        except Abort as e:
            stopped_now = True  # the decision kills every actor at once: nothing left to stop one by one
            ft.failed("run", e, step=0)  # StopNow: raises Abort again
            raise
        finally:
            if not stopped_now:
                topo.stop()
            sink.close()


def train(cfg: Any, model_path: str, resume: bool = False) -> dict[str, Any]:
    """Runs the roles on Ray to cfg.run.steps learner steps; returns the summary (also summary.json)."""
    with ray_training(cfg, model_path, resume) as driver:
        return driver.finish(driver.run(cfg.run.steps))
