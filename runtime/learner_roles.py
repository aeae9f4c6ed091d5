"""The learner role as Ray runs it: one `Learner`, or one rank of the sharded learner (learner.ranks > 1),
built inside its actor with the store client and the ZeroMQ weight publisher, and the host classes that
hold them (runtime/remote.py; runtime/learner_group.py starts them).
"""

from __future__ import annotations

from typing import Any

from configs.schema import parse_config
from learner.learner import Learner
from learner.sharded import ShardedLearner
from runtime.remote import host_class
from storage.replay_store_actor import RemoteStore


def build_learner(cfg: dict[str, Any], model_path: str, store: Any, resume: bool = False) -> Learner:
    """The learner role in its actor: restores the newest checkpoint when resuming and rewinds the store to
    its watermark, so no batch is trained twice and none skipped (learner/learner.py)."""
    from learner.weight_publisher import WeightPublisher

    config = parse_config(cfg)
    model, tokenizer = _load_model(config, model_path)
    w = config.weights
    publisher = WeightPublisher(w.bind_host, w.port, w.chunk_mb, w.auth)
    learner = Learner(model, config, store=RemoteStore(store), weights=publisher, tokenizer=tokenizer)
    learner.start(resume)
    return learner


def build_learner_rank(
    cfg: dict[str, Any],
    model_path: str,
    store: Any,
    rank: int,
    world: int,
    address: tuple[str, int],
    resume: bool = False,
) -> Learner:
    """One rank of the sharded learner (learner.ranks > 1), after joining the process group: `Learner` with
    the FSDP2 ranks' parallel plan (learner/sharded.py). Rank 0 is the learner as the rest of the system sees
    it: it alone holds the store client and the weight publisher."""
    from learner.device import learner_device
    from learner.distributed import init_process_group
    from learner.weight_publisher import WeightPublisher

    config = parse_config(cfg)
    timeout = config.learner.collective_timeout_s
    init_process_group(rank, world, address[0], address[1], timeout, learner_device(config))
    model, tokenizer = _load_model(config, model_path)
    w = config.weights
    publisher = WeightPublisher(w.bind_host, w.port, w.chunk_mb, w.auth) if rank == 0 else None
    client = RemoteStore(store) if rank == 0 else None
    learner = ShardedLearner(model, config, store=client, weights=publisher, tokenizer=tokenizer)
    learner.start(resume)
    return learner


def _load_model(config: Any, model_path: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, config.model.threads))
    torch.manual_seed(config.run.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(model_path, local_files_only=True)


LearnerActor = host_class("LearnerActor", Learner, build_learner)
LearnerRankActor = host_class("LearnerRankActor", Learner, build_learner_rank)  # the same methods
