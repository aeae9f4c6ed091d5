"""The keys of `env.name = gym`: an outside environment (SkyRL-gym, OpenEnv, verifiers) named by its factory
(actors/envs/gym, docs/environments.md).

Its own module because configs/schema.py is at the house's 400-line budget: `EnvConfig` inherits these
fields, so they are `env.factory`, `env.factory_args`, … beside the other `env.*` keys.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Self

from pydantic import Field
from pydantic.functional_validators import AfterValidator, model_validator
from pydantic.types import StrictStr

from configs.fields import Float, NonEmptyStr, PosFloat, PosInt, Section, rule
from configs.messages import Allowed

FACTORY = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"


class FactoryArgs(dict):  # type: ignore[type-arg]
    """The checked `env.factory_args` mapping: read-only and hashable, as every config value is."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True, default=str))

    def _frozen(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("env.factory_args is read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _frozen

    def __reduce__(self) -> Any:  # pickles (Ray) without calling the blocked update()
        return (FactoryArgs, (dict(self),))


class GymEnvKeys(Section):
    # package.module:callable: a SkyRL-gym env class (or skyrl_gym:make with factory_args.id), an OpenEnv
    # Environment class, a verifiers Taskset class; imported before anything starts (exit 2 if it cannot be)
    factory: Annotated[StrictStr, Field(pattern=FACTORY), Allowed("'package.module:callable'")] | None = None
    factory_args: Annotated[
        dict[str, Any], AfterValidator(FactoryArgs), Allowed("a mapping of the factory's keyword arguments")
    ] = Field(default_factory=dict)
    ecosystem: Literal["auto", "skyrl", "openenv", "verifiers"] = "auto"  # auto: read off the factory
    # the Python the environment runs in (its own venv, e.g. verifiers' with openai<3), as a worker process
    # spoken to over pipes in JSON lines; unset: in the sampler's own process
    python: NonEmptyStr | None = None
    call_timeout_s: PosFloat = 300.0  # a worker's reset or step; past it the worker is killed (one line)
    action_field: NonEmptyStr | None = (
        None  # OpenEnv: the Action field a turn's text goes to (unset: the one)
    )
    observation_field: NonEmptyStr | None = None  # OpenEnv: the Observation field shown (unset: its one text)
    pool_size: PosInt = 64  # live instances kept per sampler (least recently used ones are closed)
    cache_size: PosInt = 20000  # stored step outcomes per sampler (what replays are checked against)
    # a task whose share of replays that differ from the stored path exceeds this gets one line (each
    # mismatched branch is dropped and counted in env/replay_mismatch whatever this is)
    replay_mismatch_max: Annotated[Float, Field(ge=0, le=1)] = 0.0

    @model_validator(mode="after")
    def _gym_needs_a_factory(self) -> Self:
        name = getattr(self, "name", "gym")
        ok = (name == "gym") == (self.factory is not None)
        why = "'package.module:callable' with env.name = gym (and unset with any other env.name)"
        return rule(self, ok, "factory", why)
