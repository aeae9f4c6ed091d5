"""One local Ray instance per test session, sized for the topology tests (2 samplers + learner + spares)."""

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from configs.schema import load_config
    from runtime.driver import init_ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(load_config(overrides=["sampler.num_samplers=4"]))  # 4 + learner = 5 logical CPUs
    yield ray
    ray.shutdown()
