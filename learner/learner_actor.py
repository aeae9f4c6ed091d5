"""Ray shell around Learner (≤100 lines): take a fixed batch → step → publish weights → checkpoint.

The store's consumed watermark goes into every checkpoint; on resume the learner restores model, optimizer,
RNG and version, then rewinds the store to that watermark, so no batch is trained twice and none skipped.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from configs.schema import parse_config
from learner.learner import Learner
from learner.weight_publisher import WeightPublisher
from storage.tree_codec import decode_trees, ipc_to_table
from system.staleness import batch_metrics, version_lags


class LearnerActor:
    def __init__(self, cfg: dict, model_path: str, store: Any, resume: bool = False) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = parse_config(cfg)
        torch.set_num_threads(max(1, self.cfg.model.threads))
        torch.manual_seed(self.cfg.run.seed)
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.learner = Learner(model, self.cfg)
        self.store, self.run_dir = store, self.cfg.run.run_dir
        self.step_count = 0
        w = self.cfg.weights
        self.publisher = WeightPublisher(w.bind_host, w.port, w.chunk_mb, w.auth)
        if resume:
            ckpt = self.learner.restore(self.run_dir)
            if ckpt is not None:
                self.step_count = ckpt.step
                ray.get(store.rewind_to.remote(int(ckpt.extra["watermark"])))
        ray.get(store.set_learner_version.remote(self.learner.version))
        self.publisher.publish(self.learner.named_weights(), self.learner.version)
        self.wait_s = 0.0
        self.lag_history: list[int] = []  # per-tree version lags since the last pop, for the histogram

    def pop_lags(self) -> list[int]:
        lags, self.lag_history = self.lag_history, []
        return lags

    def pid(self) -> int:
        return os.getpid()

    def endpoint(self) -> tuple[str, bytes | None]:
        return self.publisher.endpoint, self.publisher.public_key

    def progress(self) -> dict[str, int]:
        return {"step": self.step_count, "version": self.learner.version}

    def train_step(self) -> dict[str, float] | None:
        """One step on the next fixed batch, or None when B credited trees are not there yet."""
        t0 = time.perf_counter()
        batch_index = ray.get(self.store.consumed_watermark.remote())  # the store calls it batch k
        buf = ray.get(self.store.take_batch_ipc.remote(self.cfg.learner.batch_trees))
        if buf is None:
            time.sleep(0.05)  # no full batch yet: back off instead of spinning the store actor
            self.wait_s += time.perf_counter() - t0
            return None
        trees = decode_trees(ipc_to_table(buf), source="batch")
        lags = version_lags(trees, self.learner.version)
        metrics = {**batch_metrics(trees, self.learner.version), **self.learner.step(trees)}
        self.lag_history.extend(lags.tolist())
        t1 = time.perf_counter()
        self.publisher.publish(self.learner.named_weights(), self.learner.version)
        metrics["weights/publish_s"] = time.perf_counter() - t1
        ray.get(self.store.set_learner_version.remote(self.learner.version))
        self.step_count += 1
        if self.step_count % self.cfg.learner.checkpoint_every == 0:
            watermark = ray.get(self.store.consumed_watermark.remote())
            self.learner.save(self.run_dir, self.step_count, {"watermark": watermark}, self.tokenizer)
        metrics["learner/wait_for_batch_s"] = self.wait_s
        metrics["learner/idle_ratio"] = self.wait_s / max(self.wait_s + time.perf_counter() - t0, 1e-9)
        metrics["learner/step"] = float(self.step_count)
        metrics["learner/batch_index"] = float(batch_index)
        self.wait_s = 0.0
        return metrics

    def save_final(self) -> str:
        watermark = ray.get(self.store.consumed_watermark.remote())
        return str(self.learner.save(self.run_dir, self.step_count, {"watermark": watermark}, self.tokenizer))

    def stop(self) -> None:
        self.publisher.close()
