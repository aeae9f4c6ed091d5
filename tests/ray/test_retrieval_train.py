"""`treeopsd train`'s topology with `env.retriever = service`: start_topology starts ONE retrieval service
for both samplers and hands them its URL; stopping the service mid-run turns searches into tool-error
observations, training still reaches its steps, and `env/retrieval_errors` > 0 reaches the metrics."""

from __future__ import annotations

import pytest
from test_train_e2e import small_cfg as train_e2e_cfg

from runtime.driver import Driver, start_topology, stop_topology
from storage.metrics import MemorySink
from system.roles import RetrievalRole

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def searching_model(tmp_path_factory):
    """The tiny model after 80 SFT steps on oracle turns (~15 s): its turns are mostly `search: ...`."""
    from actors.policy.warmstart import warmstart

    out = tmp_path_factory.mktemp("searching-model")
    warmstart(out, steps=80, n_train=400, eval_per_hop=1, progress=False)
    return str(out)


def small_cfg(run_dir, **extra):
    """test_train_e2e's small run, searching through the run's retrieval service."""
    service = {"env.retriever": "service", "env.retriever_retries": 1, "env.retriever_timeout_s": 2}
    return train_e2e_cfg(run_dir, **{**service, **extra})


def test_training_goes_on_when_the_shared_service_stops(ray_cluster, tmp_path, searching_model):
    ray = ray_cluster
    cfg = small_cfg(tmp_path)
    topo = start_topology(cfg, searching_model)
    sink = MemorySink()
    try:
        info = ray.get(topo.retrieval.call(RetrievalRole.describe))
        assert info["url"].startswith("http://127.0.0.1:") and info["passages"] == 1140  # the synthetic KB
        assert topo.spec.data["env"]["retriever_url"] == info["url"]  # what every sampler is built from
        driver = Driver(cfg, topo, sink)
        assert driver.run(1)["steps"] == 1
        before = max((v for _, v in sink.series.get("env/retrieval_errors", [])), default=0.0)
        ray.get(topo.retrieval.call(RetrievalRole.stop))  # mid-run: later searches are refused
        summary = driver.run(4)  # at step 1 admission allows 6 trees: trees 7 and 8 search a dead service
        assert summary["steps"] == 4 and summary["sampler_failures"] == 0
    finally:
        stop_topology(topo)
    errors = [v for _, v in sink.series["env/retrieval_errors"]]
    assert before == 0.0 and max(errors) > 0
    assert (tmp_path / "retrieval" / "corpus.jsonl.index" / "bm25" / "manifest.json").is_file()
