"""`make test`'s pytest-xdist groups (tests/conftest.py): the tests that share the process's Ray instance run
in one group, those that share the vLLM engine in another, the real-model run in its own, every other test
with its module; read from a real collection of those modules."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _suite_conftest():
    """tests/conftest.py by its path: the name `conftest` is also tests/ray's, the one pytest loaded last."""
    spec = importlib.util.spec_from_file_location("suite_conftest", ROOT / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_conftest = _suite_conftest()
xdist_group, start_order = _conftest.xdist_group, _conftest.start_order

FILES = [
    "tests/ray/test_supervision.py",  # the session's Ray instance (ray_cluster)
    "tests/ray/test_node_drill.py",  # a child-process drill, and a fake GPU cluster in this process
    "tests/ray/test_real_model_e2e.py",  # its own group
    "tests/ray/test_drill_cli.py",  # `treeopsd drill` as a child: its own Ray instance
    "tests/component/test_vllm_backend.py",  # the shared vLLM engine
    "tests/unit/test_decisions.py",
]


class Groups:
    def __init__(self) -> None:
        self.by_test: dict[str, str] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            self.by_test[item.nodeid] = item.get_closest_marker("xdist_group").args[0]


def test_each_test_gets_the_group_of_what_it_shares():
    groups = Groups()
    assert pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *FILES], plugins=[groups]) == 0
    found = {nodeid.split("::")[1].split("[")[0]: g for nodeid, g in groups.by_test.items()}
    assert found["test_a_learner_past_its_budget_stops_the_run_naming_it"] == "ray"
    assert found["test_ranks_land_node_by_node_with_fake_gpus"] == "ray"  # gpu_cluster replaces the instance
    assert found["test_the_run_heals_after_losing_the_learners_node"] == "tests/ray/test_node_drill.py"
    assert found["test_smollm2_sft_async_rl_and_eval"] == "ray-real-model"
    assert found["test_train_reaches_its_steps_with_every_role_killed_once"] == "tests/ray/test_drill_cli.py"
    vllm = {g for n, g in groups.by_test.items() if n.startswith("tests/component/test_vllm_backend.py")}
    assert vllm == {"vllm", "tests/component/test_vllm_backend.py"}  # one of its tests builds no engine
    assert {g for n, g in groups.by_test.items() if "test_decisions" in n} == {"tests/unit/test_decisions.py"}


def test_the_group_rule():
    assert xdist_group("tests/ray/a.py::t", ["tmp_path", "ray_cluster"]) == "ray"
    assert xdist_group("tests/c/b.py::t", ["vllm_lora_backend"]) == "vllm"
    assert xdist_group("tests/c/b.py::t[1]", ["tmp_path"]) == "tests/c/b.py"
    assert xdist_group("tests/ray/a.py::t", ["ray_cluster"], explicit="mine") == "mine"
    # the second Ray instance's modules
    assert xdist_group("tests/ray/test_train_e2e.py::t", ["ray_cluster"]) == "ray-b"
    assert xdist_group("tests/ray/test_train_e2e.py::t", ["tmp_path"]) == "tests/ray/test_train_e2e.py"
    # the Ray-instance groups first, in LONGEST_FIRST's order; every other group after them, as collected
    assert start_order("ray") == 0 < start_order("ray-b") < start_order("ray-real-model") < start_order("x")
    assert start_order("x") == start_order("vllm") == start_order("tests/u/a.py")


def test_xdist_runs_each_group_on_one_worker():
    """Two workers, two modules of several tests each: each module's tests on one worker (with pytest 9.2 and
    xdist 3.8 they would be dealt out one by one, pytest-dev/pytest-xdist#1386, without conftest's fix)."""
    modules = ["tests/unit/test_step_line.py", "tests/unit/test_external_tally.py"]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v"]
    done = subprocess.run([*cmd, *modules], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    ran = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED (\S+?)::(\S+)@(\S+)", done.stdout)
    passed = int(re.findall(r"(\d+) passed", done.stdout)[-1])
    assert len(ran) == passed >= 4, done.stdout[-2000:]  # every test ran, each named with its group
    for module in modules:
        workers = {w for w, path, _, group in ran if path == module and group == module}
        assert len(workers) == 1, (module, ran)
