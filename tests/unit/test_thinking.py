"""Thinking spans of the synthetic task (`env.think_tokens`, actors/envs/thinking.py): what the oracle writes,
what the environment asks for, and that a span never reaches the parser."""

from __future__ import annotations

import random
import re

import pytest

from actors.envs.synthetic_kb import SyntheticKBEnv
from actors.envs.thinking import THINK_WORDS, chunks_for, think_text
from actors.envs.tool_calls import parse_tool_call
from configs.schema import ConfigError, load_config


@pytest.fixture(scope="module")
def env() -> SyntheticKBEnv:
    return SyntheticKBEnv(think_chunks=3)


def test_a_span_counts_down_its_chunks_in_thinking_words():
    span = think_text(3, random.Random(0))
    assert span.startswith("\n<think> 2 ") and span.endswith(" </think>")
    words = span.split()[1:-1]  # between the tags: 3 chunks of a number and six words
    assert len(words) == 3 * 7 and [words[0], words[7], words[14]] == ["2", "1", "0"]
    assert all(w in THINK_WORDS for i, w in enumerate(words) if i % 7)
    assert think_text(0, random.Random(0)) == "" and chunks_for(64) == 8


def test_the_env_asks_for_the_budget_and_the_oracle_spends_it_after_each_call(env):
    task = env.tasks("train", n=1, hops=(2, 2))[0]
    assert env.user_prompt(task) == task.question + "\nThink 3."
    turns = env.oracle_turns(task, random.Random(1))
    assert len(turns) == 3  # two searches and the answer
    for action, obs in turns:
        call, span = action.split("\n", 1)
        assert span.startswith("<think> 2 ") and span.count(" 0 ") == 1
        assert parse_tool_call(action, env.plain_args).raw == call  # the span never reaches the parser
        assert obs is None or obs.endswith("\nThink 3.")
    assert turns[-1][0].startswith("answer: " + task.answers[0])
    assert env.search(task.meta["chain"][0] + " " + task.meta["path"][0]).endswith("\nThink 3.")


def test_the_oracle_without_thinking_is_unchanged():
    plain = SyntheticKBEnv()
    task = plain.tasks("train", n=1, hops=(2, 2))[0]
    assert all("<think>" not in a and (o is None or "Think" not in o) for a, o in plain.oracle_turns(task))
    assert plain.user_prompt(task) == task.question


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["env.think_tokens=60"], "env.think_tokens"),  # not a multiple of 8
        (["env.think_tokens=520", "env.max_turn_tokens=600"], "env.think_tokens"),  # past 512
        (["env.think_tokens=64"], "env.max_turn_tokens = 48 is invalid: expected >= env.think_tokens + 48"),
    ],
)
def test_think_tokens_rules_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=overrides)
    assert load_config(overrides=["env.think_tokens=64", "env.max_turn_tokens=112"]).env.think_tokens == 64
