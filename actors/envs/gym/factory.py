"""`env.factory`: the outside environment, named as `package.module:callable`, imported and told apart.

    backend = load_backend("skyrl_gym:make", {"id": "gsm8k_multi_turn"})         # a SkyRL-gym env
    backend = load_backend("echo_env.server.echo_env_environment:EchoEnvironment", {})   # OpenEnv
    backend = load_backend("kb_tools.taskset:KBTaskset", {"num_tasks": 4})      # a verifiers taskset

Which ecosystem a factory belongs to is read off what it is (a class's bases, a function's module), or
set by `env.ecosystem`. Everything here is stdlib: the subprocess worker (actors/envs/gym/worker.py) imports
it in another Python, the one the environment was installed into (`env.python`).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

ECOSYSTEMS = ("skyrl", "openenv", "verifiers")
SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
# (module prefix of a base class or function, base class name or None for a function) -> ecosystem
_MARKS = (
    ("skyrl_gym", "Env", "skyrl"),
    ("skyrl_gym", None, "skyrl"),  # skyrl_gym.make, and registry helpers
    ("openenv.core", "Environment", "openenv"),
    ("verifiers", "Taskset", "verifiers"),
)


class FactoryError(ValueError):
    """`env.factory` cannot be used; the message is one line naming the key and the cause."""


def import_factory(spec: str) -> Any:
    """The object `module:attr.sub` names, or a FactoryError saying why not (one line)."""
    if not SPEC.match(spec):
        raise FactoryError(f"env.factory = {spec!r}: expected 'package.module:callable'")
    module_name, _, attrs = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise FactoryError(f"env.factory = {spec!r}: no module named {exc.name!r}") from None
    except Exception as exc:  # the module raised while importing
        raise FactoryError(
            f"env.factory = {spec!r}: importing {module_name} raised {one_line(exc)}"
        ) from None
    for attr in attrs.split("."):
        if not hasattr(obj, attr):
            raise FactoryError(f"env.factory = {spec!r}: {module_name} has no attribute {attrs!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise FactoryError(f"env.factory = {spec!r}: {attrs} is a {type(obj).__name__}, not callable")
    return obj


def ecosystem_of(factory: Any, spec: str, ecosystem: str = "auto") -> str:
    """`ecosystem` unless auto; else the ecosystem of the factory's bases (a class) or module (a function)."""
    if ecosystem != "auto":
        if ecosystem not in ECOSYSTEMS:
            raise FactoryError(f"env.ecosystem = {ecosystem!r}: expected auto or one of {ECOSYSTEMS}")
        return ecosystem
    if isinstance(factory, type):
        for klass in factory.__mro__:
            for prefix, name, eco in _MARKS:
                if name == klass.__name__ and klass.__module__.startswith(prefix):
                    return eco
    else:
        module = getattr(factory, "__module__", "") or ""
        for prefix, name, eco in _MARKS:
            if name is None and module.startswith(prefix):
                return eco
    raise FactoryError(
        f"env.factory = {spec!r}: cannot tell its ecosystem (a skyrl_gym Env class or skyrl_gym.make, an "
        "OpenEnv Environment class, a verifiers Taskset class); set env.ecosystem"
    )


def load_backend(spec: str, args: dict[str, Any], ecosystem: str = "auto", options: Any = None) -> Any:
    """The backend that builds instances of the factory's environment (actors/envs/gym/drivers.py)."""
    factory = import_factory(spec)
    eco = ecosystem_of(factory, spec, ecosystem)
    if eco == "verifiers":
        from actors.envs.gym.verifiers_driver import VerifiersBackend

        return VerifiersBackend(factory, spec, args)
    from actors.envs.gym.drivers import OpenEnvBackend, SkyRLBackend

    if eco == "skyrl":
        return SkyRLBackend(factory, spec, args)
    return OpenEnvBackend(factory, spec, args, options or {})


def one_line(exc: BaseException) -> str:
    """`Type: message` on one line (a multi-line message is joined)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
