"""Ray shell of the learner role: `Learner` built from the config with the Ray store client and the ZeroMQ
weight publisher passed in; `train_step` (take batch → train → publish → checkpoint) is Learner's own.

On start it restores the newest checkpoint when resuming (model, optimizer, RNG, version) and rewinds the
store to that checkpoint's watermark, so no batch is trained twice and none skipped (learner/learner.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from configs.schema import parse_config
from learner.learner import Learner
from learner.weight_publisher import WeightPublisher
from storage.replay_store_actor import RemoteStore


class LearnerActor(Learner):
    def __init__(self, cfg: dict[str, Any], model_path: str, store: Any, resume: bool = False) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = parse_config(cfg)
        torch.set_num_threads(max(1, config.model.threads))
        torch.manual_seed(config.run.seed)
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        w = config.weights
        self.publisher = WeightPublisher(w.bind_host, w.port, w.chunk_mb, w.auth)
        super().__init__(model, config, store=RemoteStore(store), weights=self.publisher, tokenizer=tokenizer)
        self.start(resume)

    def pid(self) -> int:
        return os.getpid()

    def endpoint(self) -> tuple[str, bytes | None]:
        return self.publisher.endpoint, self.publisher.public_key

    def progress(self) -> dict[str, int]:
        return {"step": self.version, "version": self.version}

    def save_final(self) -> str:
        return str(self.save(self.cfg.run.run_dir))

    def stop(self) -> None:
        self.publisher.close()
