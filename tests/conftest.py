"""Shared pytest setup: offline, single-threaded torch, markers for scarce resources."""

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

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


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
