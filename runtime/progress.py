"""What a run on Ray shows as it trains (runtime/driver.py holds one `Progress`): the progress bar and its
postfix, or, without a bar, a step line every `logging.log_every` steps; and the store's stats as the
scalars tensorboard gets.

    progress = Progress(cfg, bar, external)      # bar: a tqdm bar or None; external: ExternalTally or None
    progress.trained(metrics, step)              # a learner step's metrics arrived
    progress.moved_to(step)                      # the learner was re-synced or restarted at `step`
"""

from __future__ import annotations

import sys
from typing import Any

from configs.schema import Config
from runtime.external_tally import ExternalTally


class Progress:
    def __init__(self, cfg: Config, bar: Any, external: ExternalTally | None) -> None:
        self.cfg, self.bar, self.external = cfg, bar, external

    def trained(self, out: dict[str, Any], step: int) -> None:
        ext = None if self.external is None else self.external.short()  # "ext 12ep 3side 0drop"
        if self.bar is not None:
            self.bar.update(1)
            postfix = {
                "reward": f"{out.get('reward/mean', 0):.3f}",
                "loss": f"{out.get('learner/loss', 0):.4f}",
            }
            self.bar.set_postfix(postfix if ext is None else {**postfix, "ext": ext.removeprefix("ext ")})
        if getattr(self.bar, "disable", True) and step % self.cfg.logging.log_every == 0:
            print(step_line(out, step, self.cfg.run.steps, ext), file=sys.stderr, flush=True)

    def moved_to(self, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()


def step_line(metrics: dict[str, float], step: int, target: int, ext: str | None = None) -> str:
    """The line a run without a progress bar prints every `logging.log_every` steps (`ext`: the external
    agent's counters, runtime/external_tally.py, with env.harness)."""
    reward, loss = metrics.get("reward/mean", float("nan")), metrics.get("learner/loss", float("nan"))
    step_s = metrics.get("learner/step_s", float("nan"))
    line = f"step {step}/{target}: reward {reward:.3f}, loss {loss:.4f}, learner {step_s:.2f} s/step"
    return line if ext is None else f"{line}, {ext}"


def store_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """The store's `stats()` as tensorboard scalars (store/trees_*, store/quarantined, store/reserved)."""
    trees = stats["trees"]
    out = {f"store/trees_{k}": float(trees[k]) for k in ("raw", "credited", "consumed", "total")}
    out["store/trees_pending"] = float(trees["raw"] + trees["credited"])
    out["store/quarantined"] = float(stats["quarantined"])
    out["store/reserved"] = float(stats["admission"]["reserved"])
    return out
