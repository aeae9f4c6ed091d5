"""Live sampler scaling during a run: 1 → 3 → 1 samplers through `treeopsd scale`; the new samplers are on
the current weight version within one broadcast; nothing in the store is lost."""

import pytest
import yaml
from test_train_e2e import small_cfg

from configs.schema import to_dict
from launch.cmd_scale import request_scale
from runtime.driver import Driver, start_topology, stop_topology
from storage.metrics import MemorySink
from storage.store_verify import verify_store
from system.roles import LearnerRole, SamplerRole, StoreRole

pytestmark = pytest.mark.ray


def versions(topo):
    return topo.ask_samplers(SamplerRole.version, timeout_s=60)


def test_scale_up_and_down_while_training(ray_cluster, tmp_path, tiny_model_dir):
    ray = ray_cluster
    cfg = small_cfg(tmp_path, **{"sampler.num_samplers": 1})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    topo = start_topology(cfg, tiny_model_dir)
    try:
        driver = Driver(cfg, topo, MemorySink())
        driver.run(1)
        assert request_scale(tmp_path, 3) == {"samplers": 3, "seq": 1}
        driver.run(3)
        assert len(topo.sampler_ids()) == 3
        learner_version = ray.get(topo.learner.call(LearnerRole.progress))["version"]
        # every sampler, old or new, is within one broadcast of the learner (it polls at each call)
        assert all(v >= learner_version - 1 for v in versions(topo).values()), versions(topo)
        request_scale(tmp_path, 1)
        driver.run(5)
        # retiring samplers finish their last call first; on a loaded machine that can outlast 2 steps
        assert driver.finish_retiring(timeout_s=300)
        assert len(topo.sampler_ids()) == 1 and not topo.retiring
        stats = ray.get(topo.store.call(StoreRole.stats))
        assert stats["trees"]["consumed"] == 10 and stats["quarantined"] == 0  # 5 batches of B = 2
    finally:
        stop_topology(topo)
    assert verify_store(tmp_path / "store").ok
    with pytest.raises(ValueError, match="not a treeopsd run directory"):
        request_scale(tmp_path / "nope", 2)
