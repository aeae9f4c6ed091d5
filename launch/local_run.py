"""The same roles as `launch/ray_run.py`, wired in one process (tests, debugging, profiling).

    sampler workers ─put_raw→ ReplayStore ─take_raw→ BackupWorker ─put_credited→ ReplayStore
    ReplayStore ─take_batch(B)→ Learner.step ─publish→ InMemoryWeightChannel ─poll (between turns)→ samplers

Synchronous by construction (one thread): each step samples until the store can hand out a fixed batch,
credits it, trains on it, publishes the weights. Nothing here imports Ray or opens a socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.backup_worker import BackupWorker
from actors.sampler_worker import SamplerWorker
from configs.schema import Config
from learner.learner import Learner
from learner.weight_publisher import InMemoryWeightChannel
from storage.replay_store import ReplayStore
from system.staleness import batch_metrics


@dataclass
class LocalRun:
    cfg: Config
    store: ReplayStore
    learner: Learner
    backup: BackupWorker
    samplers: list[SamplerWorker]
    channel: InMemoryWeightChannel
    history: list[dict[str, float]] = field(default_factory=list)

    def step(self) -> dict[str, float]:
        """Sample → credit → take one fixed batch → train → publish; returns the step's metrics."""
        b = self.cfg.learner.batch_trees
        turn = 0
        while (batch := self.store.take_batch(b)) is None:
            sampler = self.samplers[turn % len(self.samplers)]
            granted = self.store.admit(self.cfg.sampler.prompts_per_request)
            if granted:
                self.store.put_raw(sampler.sample(granted))
            self.backup.run_once()
            turn += 1
            if turn > 100 * b:
                raise RuntimeError("no batch after many sampling rounds: is admission (store.eta) blocking?")
        metrics = {**batch_metrics(batch, self.learner.version), **self.learner.step(batch)}
        self.channel.publish(self.learner.named_weights(), self.learner.version)
        self.store.set_learner_version(self.learner.version)
        self.history.append(metrics)
        return metrics

    def close(self) -> None:
        for s in self.samplers:
            s.close()
        self.store.close()


def build_local_run(cfg: Config, model_path: str, backend_factory=None) -> LocalRun:
    """`backend_factory(index) -> PolicyBackend` overrides the configured backend (tests use HF models)."""
    from transformers import AutoModelForCausalLM

    store = ReplayStore(Path(cfg.store_dir), eta=cfg.store.eta, batch_size=cfg.learner.batch_trees)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True)
    learner = Learner(model, cfg)
    channel = InMemoryWeightChannel()
    samplers = []
    for i in range(cfg.sampler.num_samplers):
        backend = backend_factory(i) if backend_factory else None
        worker = SamplerWorker(cfg, model_path, sampler_index=i, backend=backend)
        sink = channel.sink()
        worker.weight_hook = _apply_from(worker, sink)
        samplers.append(worker)
    store.set_learner_version(learner.version)
    return LocalRun(cfg, store, learner, BackupWorker(store, cfg.algo), samplers, channel)


def _apply_from(worker: SamplerWorker, sink: Any):
    def hook() -> None:
        got = sink.poll(0)
        if got is not None:
            worker.apply_weights(got[1], got[0])

    return hook
