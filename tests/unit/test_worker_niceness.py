"""A local Ray instance starts its workers at the machine's priority (nice 0), not Ray's nice 15, unless the
user set RAY_worker_niceness (runtime/topology.py:WORKER_NICENESS_ENV says why); and prestarts no idle
workers (NO_IDLE_WORKERS_ENV); a local start that missed Ray's 30-s start-up limit is tried once more, any
other error, and a cluster join, raised at once."""

from __future__ import annotations

import pytest

from configs.schema import load_config
from runtime import topology


@pytest.fixture
def fake_ray(monkeypatch):
    calls = []
    monkeypatch.setattr(topology.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(topology.ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_a_local_instance_starts_its_workers_at_nice_0(fake_ray, monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.delenv("RAY_prestart_worker_first_driver", raising=False)
    topology.init_ray(load_config())
    [kw] = fake_ray
    assert kw["address"] == "local"
    assert topology.os.environ["RAY_worker_niceness"] == "0"  # the raylet it starts reads this
    assert topology.os.environ["RAY_prestart_worker_first_driver"] == "0"  # and this: no idle workers


def test_the_user_s_niceness_is_kept(fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_worker_niceness", "5")
    topology.init_ray(load_config())
    assert len(fake_ray) == 1 and topology.os.environ["RAY_worker_niceness"] == "5"


def test_the_workers_of_a_local_instance_and_of_a_cluster_hide_scikit_learn(fake_ray, monkeypatch):
    topology.init_ray(load_config())
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    topology.init_ray(load_config())
    hooks = [kw["runtime_env"]["worker_process_setup_hook"] for kw in fake_ray]
    assert hooks == ["runtime.lean_imports.hide_unused_optional_packages"] * 2  # Ray imports it by this name


def _failing_first(monkeypatch, error: Exception) -> list[dict]:
    calls: list[dict] = []

    def init(**kw):
        calls.append(kw)
        if len(calls) == 1:
            raise error

    monkeypatch.setattr(topology.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(topology.ray, "init", init)
    monkeypatch.setattr(topology.ray, "shutdown", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


# Ray's own words for a node that missed its hard-coded 30 s (ray/_private/node.py)
TIMED_OUT = Exception("The current node timed out during startup. This could happen because some of the ...")


def test_a_local_start_that_timed_out_is_tried_once_more_with_the_same_arguments(monkeypatch):
    calls = _failing_first(monkeypatch, TIMED_OUT)
    topology.init_ray(load_config())
    assert len(calls) == 2 and calls[0] == calls[1] and calls[0]["address"] == "local"


def test_any_other_start_error_and_a_cluster_join_are_raised_at_once(monkeypatch):
    calls = _failing_first(monkeypatch, ValueError("num_cpus must be an integer"))
    with pytest.raises(ValueError, match="num_cpus"):
        topology.init_ray(load_config())
    assert len(calls) == 1
    calls = _failing_first(monkeypatch, TIMED_OUT)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.2:6379")  # a cluster's node is not ours to stop and restart
    with pytest.raises(Exception, match="timed out during startup"):
        topology.init_ray(load_config())
    assert len(calls) == 1
