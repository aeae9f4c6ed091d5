"""Ray shell of one rank of the sharded learner (learner.ranks > 1): `ShardedLearner` built from the config
after joining the learner's process group; runtime/learner_group.py starts R of them in a placement group.

Rank 0 is the learner as the rest of the system sees it: it alone holds the store client and the ZeroMQ
weight publisher, takes each batch and publishes each version. Every rank runs every call of the step
(`train_step`, `save_final`) at the same time, since each one is a sequence of collectives.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from configs.schema import parse_config
from learner.device import learner_device
from learner.distributed import init_process_group
from learner.sharded import ShardedLearner
from learner.weight_publisher import WeightPublisher
from storage.replay_store_actor import RemoteStore


class LearnerRankActor(ShardedLearner):
    def __init__(
        self,
        cfg: dict[str, Any],
        model_path: str,
        store: Any,
        rank: int,
        world: int,
        address: tuple[str, int],
        resume: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = parse_config(cfg)
        torch.set_num_threads(max(1, config.model.threads))
        torch.manual_seed(config.run.seed)
        timeout = config.learner.collective_timeout_s
        init_process_group(rank, world, address[0], address[1], timeout, learner_device(config))
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.publisher = None
        if rank == 0:
            w = config.weights
            self.publisher = WeightPublisher(w.bind_host, w.port, w.chunk_mb, w.auth)
        super().__init__(
            model,
            config,
            store=RemoteStore(store) if rank == 0 else None,
            weights=self.publisher,
            tokenizer=tokenizer,
        )
        self.start(resume)

    def pid(self) -> int:
        return os.getpid()

    def endpoint(self) -> tuple[str, bytes | None]:
        assert self.publisher is not None, "the weight endpoint is rank 0's"
        return self.publisher.endpoint, self.publisher.public_key

    def progress(self) -> dict[str, int]:
        return {"step": self.version, "version": self.version, "rank": self.rank}

    def save_final(self) -> str:
        return str(self.save(self.cfg.run.run_dir))

    def stop(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()
