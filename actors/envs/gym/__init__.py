"""Outside environments (SkyRL-gym, OpenEnv, verifiers) as our `Environment`: `env.name = gym`.

    env = build_gym_env(cfg.env)          # env.factory, env.factory_args, env.python, env.pool_size, …
    tasks = env.tasks(cfg.env.data)

The adapter (adapter.py: the pool, the observation cache, replay and its check), the factory and its
ecosystem (factory.py), each ecosystem's instances (drivers.py, verifiers_driver.py), where they run
(hosts.py: in-process, or worker.py in the environment's own Python). docs/environments.md has the rest.
"""

from __future__ import annotations

from typing import Any

from actors.envs.gym.adapter import GymEnv
from actors.envs.gym.factory import FactoryError
from actors.envs.gym.hosts import make_host

__all__ = ["FactoryError", "GymEnv", "build_gym_env", "check_gym_env"]


def build_gym_env(e: Any) -> GymEnv:
    """The adapter over `env.factory` (imported here: a FactoryError, one line, when it cannot be)."""
    if e.factory is None:
        raise FactoryError("env.factory must name the environment's factory with env.name = gym")
    options = {"action_field": e.action_field, "observation_field": e.observation_field}
    host = make_host(e.factory, e.factory_args, e.python, e.ecosystem, options, e.call_timeout_s)
    return GymEnv(host, e.factory, e.max_turns, e.pool_size, e.cache_size, e.replay_mismatch_max)


def check_gym_env(e: Any) -> int:
    """Before anything starts: the factory imports (in `env.python`'s worker, if set) and its tasks load;
    a problem is a ValueError of one line (the CLI exits 2). Returns the number of tasks."""
    env = build_gym_env(e)
    try:
        tasks = env.tasks(e.data)
        if not tasks:
            raise ValueError(f"env.factory = {e.factory}: no tasks (env.data or the ecosystem's own list)")
        return len(tasks)
    except (RuntimeError, KeyError, TypeError) as exc:  # the ecosystem's own listing failed
        raise ValueError(f"env.factory = {e.factory}: listing its tasks failed: {exc}") from None
    finally:
        env.close()
