"""Shared pytest setup: offline, single-threaded torch, markers for scarce resources, hypothesis profiles.

Hypothesis profiles (select with HYPOTHESIS_PROFILE, default "ci"):
  ci       derandomized: every run draws the same examples (a seed fixed per test), no example database;
           a failure prints its reproduction blob (``@reproduce_failure``), no deadline (loaded machines)
  explore  random examples each run (new seeds), the local example database, blobs printed: for hunting
           new failures locally; a failure found here is pinned with the printed blob or ``@seed``
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray on loopback without token auth, also when pytest runs without the Makefile's environment (a bare
# ray.init() would otherwise switch this process to token auth that our workers do not carry)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray workers at nice 0, as runtime/topology.py starts them: also for the test clusters started without it
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")  # runtime/topology.py:NO_IDLE_WORKERS_ENV

import pytest
from hypothesis import HealthCheck, settings

from runtime.lean_imports import hide_unused_optional_packages

hide_unused_optional_packages()  # as in every process of a run: transformers without scikit-learn

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", derandomize=False, print_blob=True, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# `make test` runs the suite on pytest-xdist workers (`-n 3 --dist loadgroup`): a group's tests run on
# one worker, one after another. The tests that share a process-wide resource through these fixtures form
# one group each (one local Ray instance, one vLLM engine); every other test goes with its module (its
# module fixtures built once). A test may name its own group (`@pytest.mark.xdist_group("...")`): the
# real-model run does, so it runs beside the shared instance's tests on a Ray instance of its own.
SHARED = {
    "ray": ("ray_cluster", "gpu_cluster", "two_nodes", "ray_local"),
    "vllm": ("vllm_backend", "vllm_lora_backend"),
}


# The shared-instance tests took ~35 of a 76-minute suite on one worker; these modules share a second local
# Ray instance on another worker (each worker is its own process, so its session fixture is its own).
SECOND_RAY = {
    "tests/ray/test_train_e2e.py",
    "tests/ray/test_retrieval_train.py",
    "tests/ray/test_sampler_failure.py",
    "tests/ray/test_external_train.py",
    "tests/ray/test_learner_group.py",
}
# The groups with a Ray instance of their own start first, in this order, so that none of them is left to
# run alone at the end (`make test` passes --no-loadscope-reorder: xdist keeps this order). The modules that
# start Ray in a subprocess follow in collection order, among light tests: started all at once beside these
# three, one of them saw Ray's 30 s node start-up limit pass on 2 cores.
LONGEST_FIRST = ("ray", "ray-b", "ray-real-model")


def xdist_group(nodeid: str, fixturenames, explicit: str | None = None) -> str:
    """The xdist group of a test: its own mark's, a SHARED resource's (the Ray one split in two by module),
    else its module's."""
    if explicit is not None:
        return explicit
    module = nodeid.split("::")[0]
    group = next((g for g, names in SHARED.items() if set(names) & set(fixturenames)), module)
    return "ray-b" if group == "ray" and module in SECOND_RAY else group


def start_order(group: str) -> int:
    """Where a group's tests go in the collection: the LONGEST_FIRST groups first, the rest as collected."""
    return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    on_worker = bool(os.environ.get("PYTEST_XDIST_WORKER")) and config.getoption("loadgroup", False)
    groups = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        group = groups[item] = xdist_group(item.nodeid, item.fixturenames, mark.args[0] if mark else None)
        if mark is None:
            item.add_marker(pytest.mark.xdist_group(group))
        if on_worker and "@" not in item.nodeid:
            _name_group(item, group)
    items.sort(key=lambda item: start_order(groups[item]))  # stable: the rest keep their order
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _has_gpu():  # torch is imported only to answer this (3 CPU-s a process)
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _name_group(item, group: str) -> None:
    """The group as the suffix of the test's id that xdist's loadgroup scheduler reads (`id@group`). xdist
    3.8 writes it into `item._nodeid`, which pytest 9.2 no longer reads (its ids are structured, `item._id`),
    so its loadgroup silently stops grouping (pytest-dev/pytest-xdist#1386): it is written here instead."""
    from _pytest.nodeid import NodeId

    item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init tiny Qwen2 + BPE tokenizer trained on the default task's text (built once, ~2 s)."""
    from actors.envs.synthetic_kb import SyntheticKBEnv, tokenizer_texts
    from actors.policy.tiny_model import save_tiny

    folder = tmp_path_factory.mktemp("tiny-model")
    save_tiny(folder, tokenizer_texts(SyntheticKBEnv(), n_questions=300, n_oracle=30), seed=0)
    return str(folder)


@pytest.fixture(scope="session")
def tok():
    """The small BPE tokenizer of the learner tests (tests/learner_fixtures.py)."""
    from learner_fixtures import small_tokenizer

    return small_tokenizer()
