"""Failures that explain themselves (actors/failures.py, storage/role_log.py): a sampler that cannot start
raises one line with the root cause, the config key to blame and its log file; the driver finds that line
again in what Ray hands back (a failed call, or a constructor's ActorDiedError text)."""

from __future__ import annotations

import logging
import pickle
import traceback
from typing import Any

import pytest

from actors.failures import SamplerConfigFailure, SamplerFailure, explain, failure, from_ray_error
from actors.policy.tiny_model import build_tokenizer
from actors.sampler_setup import sampler_parts
from configs.schema import ConfigError, load_config
from storage.role_log import role_log_path, setup_role_log


class _Backend:  # only what sampler_parts reads before the chat template fails
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.version, self.closed = tokenizer, 0, False

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def broken_tokenizer() -> Any:
    tok = build_tokenizer(["a b c d e", "search: x answer: y"])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}"  # the for is never closed
    return tok


def test_a_broken_chat_template_names_the_model_path(tmp_path, broken_tokenizer) -> None:
    cfg = load_config(overrides=[f"run.run_dir={tmp_path}"])
    log = setup_role_log(tmp_path, "sampler", 0, redirect_stderr=False)
    try:
        with pytest.raises(SamplerConfigFailure) as info:
            sampler_parts(cfg, "/models/broken", backend=_Backend(broken_tokenizer))
    finally:
        for h in [h for h in logging.getLogger().handlers if getattr(h, "treeopsd_role_log", None)]:
            logging.getLogger().removeHandler(h)
            h.close()
    err = info.value
    assert isinstance(err, ConfigError)  # `treeopsd train` prints a ConfigError as one line, exit 2
    assert err.key == "model.path" and err.log_path == str(log) == str(role_log_path(tmp_path, "sampler"))
    assert str(err).startswith("TemplateSyntaxError: ")
    assert str(err).endswith(f" [config key: model.path] (log: {log})")
    assert "sampler-0 started" in log.read_text()  # the role's log file exists and is written


def test_a_missing_corpus_names_env_corpus(tmp_path) -> None:
    missing = tmp_path / "no-corpus.jsonl"
    cfg = load_config(overrides=["env.name=multihop_qa", f"env.corpus={missing}", f"env.data={missing}"])
    err = explain(FileNotFoundError(2, "No such file or directory", str(missing)), cfg, None, None)
    assert err.key == "env.corpus" and err.is_config
    cfg2 = load_config(overrides=["env.name=multihop_qa"])
    named = explain(
        ValueError("env.corpus must name a local corpus file for env.name=multihop_qa"), cfg2, None, None
    )
    assert named.key == "env.corpus"


def test_an_error_of_the_code_is_no_config_failure() -> None:
    cfg = load_config()
    try:
        try:
            raise KeyError("nodes")
        except KeyError as inner:
            raise RuntimeError("the batch failed") from inner
    except RuntimeError as exc:
        err = explain(exc, cfg, None, "/r/logs/sampler-3.log")
    assert type(err) is SamplerFailure and err.key is None
    assert str(err) == "KeyError: 'nodes' (log: /r/logs/sampler-3.log)"  # the root cause: innermost
    assert pickle.loads(pickle.dumps(err)).log_path == "/r/logs/sampler-3.log"  # Ray ships it intact


def test_the_driver_finds_the_failure_in_what_ray_returns() -> None:
    import ray.exceptions as rx

    cfg = load_config()
    log = "/r/logs/sampler-0.log"
    msg = f"TemplateSyntaxError: Unexpected end of template [config key: model.path] (log: {log})"
    try:
        raise failure(msg, "model.path", log)
    except SamplerFailure as exc:
        task_error = rx.RayTaskError("SamplerActor.__init__", traceback.format_exc(), exc)
    died = rx.ActorDiedError(task_error)  # a constructor's failure: only its text reaches the driver
    got, explained = from_ray_error(died, cfg)
    assert explained and isinstance(got, SamplerConfigFailure)
    assert (str(got), got.key, got.log_path) == (msg, "model.path", log)
    got2, explained2 = from_ray_error(task_error.as_instanceof_cause(), cfg)  # a failed call: the cause
    assert explained2 and (str(got2), got2.key) == (msg, "model.path")
    other, explained3 = from_ray_error(rx.ActorDiedError(), cfg)  # killed: nothing explained it
    assert not explained3 and other.key is None
