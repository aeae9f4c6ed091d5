"""SkyRL-gym environments that misbehave on purpose, one way each (the task's record says on which task):
the adapter must name each failure in one line with the task id, and the run must go on."""

from __future__ import annotations

import random

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class _Base(BaseTextEnv):
    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.extras = dict(extras or {})
        self.bad = bool(self.extras.get("bad"))
        self.max_turns = 3

    def _obs(self, text: str, reward: float = 0.0, done: bool = False) -> BaseTextEnvStepOutput:
        obs = [] if done else [{"role": "user", "content": text}]
        return BaseTextEnvStepOutput(observations=obs, reward=reward, done=done, metadata={})

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        return self._obs(
            f"turn {self.turns}: you wrote {len(action)} characters", done=self.turns >= self.max_turns
        )


class RaisesInReset(_Base):
    def init(self, prompt):
        if self.bad:
            raise ConnectionError("the sandbox did not come up")
        return prompt, {}


class RaisesInStep(_Base):
    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.bad and self.turns == 1:
            raise KeyError("tool 'calculator' crashed")
        return super().step(action)


class NotDeterministic(_Base):
    """Its observation carries a fresh random draw: a replayed prefix never matches what was stored."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        return self._obs(f"the dice say {random.random():.6f}", done=self.turns >= self.max_turns)


class NeverEnds(_Base):
    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        return self._obs("go on", reward=0.5)


class NanReward(_Base):
    def step(self, action: str) -> BaseTextEnvStepOutput:
        out = super().step(action)
        if self.bad:
            out["reward"] = float("nan")
        return out
