"""Why a sampler failed, in one line, and the config key to change when the configuration is the cause.

    try:
        ...build or run the sampler...
    except Exception as exc:
        raise explain(exc, cfg, model_path, log_path) from exc    # a SamplerFailure

The driver (runtime/driver.py) gets it back from the failed call (`from_ray_error`): a failure the
configuration causes ends the run at once (a SamplerConfigFailure is a ConfigError, so `treeopsd train`
prints it as one line and exits 2), any other is logged and named when restarts are exhausted, instead of
timing out with "no healthy sampler; see the Ray logs". The key is found from the exception chain: a chat
template that does not render or lacks what multi-turn rollouts need (`model.path`: the tokenizer's
template; `env.protocol` when the protocol cannot use it), a file that is missing or unreadable under a
configured path (`model.path`, `env.corpus`, `env.data`, `env.eval_data`, `env.encoder`), or a message that
names a key itself (`env.corpus must name a local corpus file`).
"""

from __future__ import annotations

import re
from typing import Any

from configs.schema import ConfigError

_PATH_KEYS = ("env.corpus", "env.data", "env.eval_data", "env.encoder", "store.dir")
_SECTIONS = "run|algo|model|env|sampler|learner|store|weights|resources"
_KEY_RE = re.compile(rf"\b((?:{_SECTIONS})\.[a-z_]+(?:\.[a-z_]+)*)")
_TEMPLATE_WORDS = ("chat template", "chat_template", "jinja", "TemplateSyntaxError", "UndefinedError")


class SamplerFailure(RuntimeError):
    """A sampler's failure as the driver reports it: root cause, config key (or None), log file."""

    def __init__(self, message: str, key: str | None = None, log_path: str | None = None) -> None:
        super().__init__(message)
        self.key, self.log_path = key, log_path

    def __reduce__(self) -> Any:  # Ray ships exceptions by pickling them: keep the fields
        return (type(self), (self.args[0], self.key, self.log_path))

    @property
    def is_config(self) -> bool:
        return self.key is not None


class SamplerConfigFailure(SamplerFailure, ConfigError):
    """A failure the configuration causes (`key`): restarting cannot help, and `treeopsd train` reports a
    ConfigError as one line naming it (exit status 2) instead of a traceback."""


def failure(message: str, key: str | None, log_path: str | None) -> SamplerFailure:
    return (SamplerConfigFailure if key is not None else SamplerFailure)(message, key, log_path)


def chain(exc: BaseException) -> list[BaseException]:
    """The exception and everything it was raised from, outermost first."""
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return out


def _paths(cfg: Any, model_path: str | None) -> dict[str, str]:
    found = {"model.path": str(model_path or cfg.model.path or "")}
    for key in _PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name, None)
        found[key] = str(value) if value else ""
    return {k: v for k, v in found.items() if v}


def config_key(exc: BaseException, cfg: Any, model_path: str | None = None) -> str | None:
    """The config key whose value caused `exc`, or None when nothing points at the configuration."""
    paths = _paths(cfg, model_path)
    for e in chain(exc):
        text = f"{type(e).__name__}: {e}"
        if type(e).__name__ == "ProtocolError" and "env.protocol" in text:
            return "env.protocol"
        if any(w in text for w in _TEMPLATE_WORDS) or type(e).__module__.startswith("jinja2"):
            return "model.path"  # the tokenizer's chat template lives in the model folder
        filename = getattr(e, "filename", None)
        for key, value in paths.items():
            if (filename and str(filename).startswith(value)) or (isinstance(e, OSError) and value in text):
                return key
        if named := _KEY_RE.search(str(e)):
            return named.group(1)
    return None


def one_line(exc: BaseException, limit: int = 400) -> str:
    """`Type: message` of the innermost exception whose message says something, on one line."""
    for e in reversed(chain(exc)):
        if str(e).strip():
            text = " ".join(f"{type(e).__name__}: {e}".split())
            return text if len(text) <= limit else text[: limit - 1] + "…"
    return type(exc).__name__


def explain(exc: BaseException, cfg: Any, model_path: str | None, log_path: str | None) -> SamplerFailure:
    """The failure as one line: root cause, `[config key: K]` when the configuration is to blame, log file."""
    if isinstance(exc, SamplerFailure):
        return exc
    key = config_key(exc, cfg, model_path)
    msg = one_line(exc)
    if key is not None:
        msg += f" [config key: {key}]"
    if log_path:
        msg += f" (log: {log_path})"
    return failure(msg, key, log_path)


# the last line of the traceback text Ray puts into an ActorDiedError
_RAISED = re.compile(r"Sampler(?:Config)?Failure: (?P<msg>.+)$", re.M)
_KEY_TAG, _LOG_TAG = re.compile(r" \[config key: ([\w.]+)\]"), re.compile(r" \(log: ([^)]+)\)$")


def from_ray_error(err: BaseException, cfg: Any) -> tuple[SamplerFailure, bool]:
    """(the failure, whether the sampler itself explained it) from an error the driver got back for a
    sampler call: a failed call carries the actor's SamplerFailure as its `cause`; a failed constructor
    reaches the driver only as text, in Ray's ActorDiedError ("... raised in its creation task ..."); any
    other error is explained here (without a log file: the driver cannot tell which one)."""
    for e in (getattr(err, "cause", None), err):
        if isinstance(e, SamplerFailure):
            return failure(str(e.args[0]) if e.args else str(e), e.key, e.log_path), True
    found = list(_RAISED.finditer(str(err)))
    if found:
        msg = found[-1].group("msg").strip()
        key, log = _KEY_TAG.search(msg), _LOG_TAG.search(msg)
        return failure(msg, key.group(1) if key else None, log.group(1) if log else None), True
    cause = getattr(err, "cause", None)
    return explain(cause if isinstance(cause, BaseException) else err, cfg, None, None), False
