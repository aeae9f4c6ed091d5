"""The multi-turn agent loop, batched across episodes: every live episode's next turn goes to the policy
backend in one `sample` call, then each turn is parsed and executed by its environment.

Per turn (token-in/token-out): the backend returns the sampled ids and their log-probs; the ids are stored
as the turn's tokens (loss mask 1, the stop token included), decoded only for the environment's parser; the
observation text is rendered to ids by `chat` (`ChatFormat`, or the `env.protocol` in use: actors/protocols,
which also parses the turn through the env it wraps) (loss mask 0) and appended to the context. Episodes end
on an answer, an unparseable turn, `max_turns` (counted from the episode start, so a branch from anchor k
has `max_turns − k` left), or the token budget (the cut turn is terminal and keeps its tokens, §10).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from actors.chat import ChatFormat
from actors.envs.base import EnvFailure, Environment, StepResult, Task
from actors.envs.tool_calls import ToolCall
from system.policy import PolicyBackend, SampleRequest, mix_seed
from system.tree_build import TreeBuilder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopLimits:
    max_turns: int = 6
    max_turn_tokens: int = 48
    token_budget: int = 768  # whole-context limit (prompt + turns + observations)
    mask_truncated_turn: bool = False
    on_verifier_error: str = "zero"  # "zero" | "drop_tree"


@dataclass
class Episode:
    """One root-to-leaf walk being sampled into `builder`, starting under node `parent`."""

    task: Task
    builder: TreeBuilder
    parent: int  # node the next turn hangs under (0 = the prompt)
    context: list[int]
    calls: list[ToolCall | None]  # one entry per turn so far (None: the turn made no valid call)
    turns_done: int  # turns from the episode start, including a branch's shared prefix
    key: str  # backend cache key of this episode's KV (one per episode)
    seed: int | None = None  # turn t draws with mix_seed(seed, t) (None: the backend's own stream)
    parent_key: str | None = None  # cache to start from: None = prefill, a trunk's key for a branch
    nodes: list[int] = field(default_factory=list)  # node ids this episode created, in order
    done: bool = False
    finish: str | None = None
    reward: float | None = None
    verifier_failed: bool = False
    dropped: str | None = None  # why the episode must not be trained on (an outside env's replay mismatch)


def run_episodes(
    episodes: Sequence[Episode],
    backend: PolicyBackend,
    env: Environment,
    chat: ChatFormat,
    limits: LoopLimits,
    between_rounds: Callable[[], object] | None = None,
) -> None:
    """Steps every episode to its end; each finished episode's last node is a leaf with its reward. Before
    each round of turns, `between_rounds` runs (the sampler: new weights loaded, `TreeSampler.catch_up`):
    turns sampled after it carry the new version, and no turn is ever split between two."""
    live = [e for e in episodes if not e.done]
    while live:
        if between_rounds is not None:
            between_rounds()
        requests, stepping = [], []
        for e in live:
            if (req := turn_request(e, chat, limits)) is not None:
                requests.append(req)
                stepping.append(e)
        results = backend.sample(requests) if requests else []
        version = int(getattr(backend, "version", 0))
        for e, res in zip(stepping, results, strict=True):
            _apply_turn(e, res.token_ids, res.logprobs, res.finish_reason, version, env, chat, limits)
        live = [e for e in live if not e.done]


def turn_request(e: Episode, chat: ChatFormat, limits: LoopLimits) -> SampleRequest | None:
    """The episode's next turn as a request (both loops: this one and actors/async_loop.py), or None after
    ending the episode when its context has filled the token budget."""
    room = limits.token_budget - len(e.context)
    if room <= 0:
        _end(e, "token_budget", 0.0)
        return None
    return SampleRequest(
        context=e.context,
        max_new_tokens=min(limits.max_turn_tokens, room),
        stop_token_ids=chat.stop_token_ids,
        stop_strings=chat.stop_strings,  # the protocol's text stops (`</search>`), if any
        cache_key=e.key,  # the backend extends an episode's cache in place turn by turn
        parent_key=e.parent_key,
        # the turn's own draws, whichever loop runs it and whatever runs beside it
        seed=None if e.seed is None else mix_seed(e.seed, e.turns_done),
    )


def _apply_turn(e, tokens, logprobs, finish_reason, version, env, chat, limits) -> None:
    truncated = record_turn(e, tokens, logprobs, finish_reason, version, limits)
    finish_turn(e, step_turn(env, e, chat, tokens), truncated, tokens, chat, limits)


def record_turn(e: Episode, tokens, logprobs, finish_reason: str, version: int, limits: LoopLimits) -> bool:
    """The sampled turn into the tree under the episode's parent; True when it was cut (not stopped)."""
    truncated = finish_reason != "stop"
    mask = [not (truncated and limits.mask_truncated_turn)] * len(tokens)
    node = e.builder.add_turn(e.parent, tokens, logprobs, loss_mask=mask, policy_version=version)
    e.nodes.append(node)
    e.parent, e.turns_done = node, e.turns_done + 1
    e.parent_key = e.key
    return truncated


def step_turn(env: Environment, e: Episode, chat: ChatFormat, tokens) -> StepResult | None:
    """The environment's answer to the turn (the tool call runs here; None: the environment raised).
    Touches neither the tree nor the episode, so the async loop runs it in a worker thread."""
    return _safe_step(env, e, chat.decode_turn(tokens))


def finish_turn(e: Episode, result: StepResult | None, truncated: bool, tokens, chat, limits) -> None:
    """Ends the episode or appends the observation after the turn recorded last (`record_turn`)."""
    node = e.nodes[-1]
    if result is None:
        _end(e, "verifier_error", 0.0, failed=True)
    elif result.done:
        _end(e, result.info.get("finish") or "done", float(result.reward or 0.0))
        e.dropped = result.info.get("drop")  # the sampler removes this episode's turns from the tree
    elif truncated:
        _end(e, "truncated", 0.0)  # a cut turn cannot be continued: terminal, reward per verifier (none: 0)
    elif e.turns_done >= limits.max_turns:
        _end(e, "max_turns", 0.0)
    else:
        e.calls.append(result.call)
        messages = result.info.get("messages")  # an outside env's observation, as chat messages
        if messages and hasattr(chat, "messages_tokens"):
            obs = chat.messages_tokens(messages, tokens)
        else:
            obs = chat.observation_tokens(result.observation or "", tokens)  # after this turn's own ids
        e.builder.set_observation(node, obs)
        e.context = [*e.context, *tokens, *obs]


def _safe_step(env: Environment, e: Episode, text: str) -> StepResult | None:
    try:
        return env.step(e.task, [c for c in e.calls if c is not None], text)
    except EnvFailure as exc:  # an outside environment's failure, already one line naming the task
        log.warning("%s", exc)
        return None
    except Exception:  # environments must not raise; if one does, the tree records a verifier error
        log.exception("environment %s raised on task %s", getattr(env, "name", "?"), e.task.task_id)
        return None


def _end(e: Episode, finish: str, reward: float, failed: bool = False) -> None:
    e.done, e.finish, e.reward, e.verifier_failed = True, finish, reward, failed
    if e.nodes:
        e.builder.set_reward(e.nodes[-1], reward)
