"""The same roles as on Ray, built by the same builder (runtime/builder.py), wired in one process (tests,
debugging, experiments, profiling).

    TreeSampler.sample_and_commit ─put_raw→ ReplayStore ─lease_raw→ BackupWorker.run_once ─put_credited→ store
    store ─take_batch(B)→ Learner.train_step ─publish→ InMemoryWeightChannel ─poll (between turns)→ samplers

The store here is the `ReplayStore` object itself (the `StoreClient` interface), the weights go through the
in-memory twin of the ZeroMQ broadcast. Synchronous by construction (one thread): each step asks the learner
for a batch and, while there is none, has the samplers sample (round robin) and the backup credit. Nothing
here imports Ray or opens a socket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from actors.backup_worker import BackupWorker
from actors.tree_sampler import TreeSampler
from configs.schema import Config, ConfigError
from learner.learner import Learner
from runtime.builder import make_backup, make_learner, make_sampler, make_store, store_options
from storage.replay_store import ReplayStore
from system.policy import PolicyBackend
from system.weight_channel import InMemoryWeightChannel


@dataclass
class LocalRun:
    cfg: Config
    store: ReplayStore
    learner: Learner
    backup: BackupWorker
    samplers: list[TreeSampler]
    channel: InMemoryWeightChannel
    sinks: list[InMemoryWeightChannel] = field(default_factory=list)  # the samplers' lagged readers
    history: list[dict[str, float]] = field(default_factory=list)

    def step(self) -> dict[str, float]:
        """Sample → credit → take one fixed batch → train → publish; returns the step's metrics."""
        b, turn = self.cfg.learner.batch_trees, 0
        while (metrics := self.learner.train_step()) is None:
            self.samplers[turn % len(self.samplers)].sample_and_commit(self.cfg.sampler.prompts_per_request)
            self.backup.run_once()
            turn += 1
            if turn > 100 * b:
                raise RuntimeError("no batch after many sampling rounds: is admission (store.eta) blocking?")
        if (limit := metrics.get("store/lag_limit")) is not None:  # store.max_turn_kl: drift bounds the lag
            for sink in self.sinks:
                sink.lag = min(self.cfg.run.sampler_lag, int(limit))
        self.history.append(metrics)
        return metrics

    def close(self) -> None:
        for s in self.samplers:
            s.close()
        self.store.close()


def build_local_run(
    cfg: Config, model_path: str, backend_factory: Callable[[int], PolicyBackend] | None = None
) -> LocalRun:
    """`backend_factory(index) -> PolicyBackend` overrides the configured backend (tests use HF models)."""
    if cfg.learner.ranks > 1:  # ranks are processes: only the Ray wiring starts them
        raise ConfigError(
            f"learner.ranks = {cfg.learner.ranks} is invalid: expected 1 when the roles run in one process "
            "(runtime/local.py); the sharded learner runs on Ray (treeopsd train)"
        )
    store = make_store(str(Path(cfg.store_dir)), **store_options(cfg))
    channel = InMemoryWeightChannel()
    learner = make_learner(cfg, model_path, store=store, weights=channel)
    sinks = [channel.sink(lag=cfg.run.sampler_lag) for _ in range(cfg.sampler.num_samplers)]
    samplers = [
        make_sampler(
            cfg,
            model_path,
            index=i,
            store=store,
            weights=sink,
            backend=backend_factory(i) if backend_factory else None,
        )
        for i, sink in enumerate(sinks)
    ]
    return LocalRun(cfg, store, learner, make_backup(cfg, store), samplers, channel, sinks)
