"""The asynchronous agent loop (actors/async_loop.py) against the lockstep one (actors/agent_loop.py):
many episodes in flight build the same trees under fixed seeds (structure, token ids, log-probs; HF
backend and a request-seeded scripted backend with branches), at most `max_inflight` episodes run at
once, and a weight version arriving mid-episode is applied at a turn boundary and stamped on the turns
sampled after it. Waits are events with bounds; nothing sleeps."""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import numpy as np
import pytest

from actors.agent_loop import LoopLimits
from actors.chat import ChatFormat
from actors.envs.synthetic_kb import KBConfig, SyntheticKBEnv, tokenizer_texts
from actors.policy.tiny_model import build_tiny_model, build_tokenizer
from actors.tree_sampler import TreeSampler, TreeShape
from system.policy import SampleResult, SamplingConfig
from tests.fakes import MENU

BOUND_S = 30.0


@pytest.fixture(scope="module")
def kb_env() -> SyntheticKBEnv:
    return SyntheticKBEnv(config=KBConfig(n_persons=40, n_companies=10, n_cities=12, n_countries=5))


@pytest.fixture(scope="module")
def tokenizer(kb_env: SyntheticKBEnv) -> Any:
    return build_tokenizer(tokenizer_texts(kb_env, n_questions=200, n_oracle=20))


class SeededScripted:
    """A menu backend (tests/fakes.py) whose pick comes from the request's own seed, so a turn is the same
    whichever loop runs it and whatever runs beside it; records the version each turn was sampled at."""

    def __init__(self, tokenizer: Any, menu: tuple[str, ...] = MENU) -> None:
        self.tok, self.menu, self.version, self.calls = tokenizer, menu, 0, 0
        self.eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.seen: dict[tuple[tuple[int, ...], tuple[int, ...]], set[int]] = {}
        self.on_call: Any = None

    def sample(self, requests: Any) -> list[SampleResult]:
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        out = []
        for req in requests:
            assert req.seed is not None  # the agent loop seeds every turn
            pick = int(np.random.default_rng(req.seed).integers(len(self.menu)))
            ids = [*self.tok.encode(self.menu[pick].format(q="x relation", a="x"), add_special_tokens=False)]
            ids, finish = [*ids, self.eos], "stop"
            if len(ids) > req.max_new_tokens:
                ids, finish = ids[: req.max_new_tokens], "length"
            self.seen.setdefault((tuple(req.context), tuple(ids)), set()).add(self.version)
            lp = -math.log(len(self.menu)) / len(ids)
            out.append(SampleResult(ids, [lp] * len(ids), finish))
        return out

    def score(self, context: Any, start: int) -> list[float]:  # pragma: no cover - not a model
        raise NotImplementedError

    def load_weights(self, named_tensors: Any, version: int) -> None:
        self.version = version

    def evict(self, *keys: str) -> None:
        pass  # no caches: nothing to free

    def close(self) -> None:
        pass


def paths(tree: Any) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Every node by its path of (turn ids, observation ids) from the root: node ids differ between loops
    (they number nodes in creation order), paths do not. Equal paths (two trunks sampling the same ids)
    are merged; their values agree anyway."""
    finish = {int(k): v for k, v in json.loads(tree.meta["finish"]).items()}
    out, key = {}, {0: ()}
    for n in tree.nodes[1:]:
        key[n.node_id] = (*key[n.parent], (tuple(n.tokens.tolist()), tuple(n.obs_tokens.tolist())))
        out[key[n.node_id]] = {
            "logprobs": n.behavior_logprobs.astype(np.float64),
            "mask": tuple(n.loss_mask.tolist()),
            "version": n.policy_version,
            "reward": None if math.isnan(n.reward) else n.reward,
            "finish": finish.get(n.node_id),
        }
    return out


def assert_same_trees(a: list[Any], b: list[Any], atol: float) -> None:
    assert [t.tree_id for t in a] == [t.tree_id for t in b]
    for x, y in zip(a, b, strict=True):
        assert x.prompt_tokens.tolist() == y.prompt_tokens.tolist()
        assert len(x.nodes) == len(y.nodes) and x.num_leaves == y.num_leaves
        px, py = paths(x), paths(y)
        assert px.keys() == py.keys()  # the same structure and the same token ids
        for k, u in px.items():
            v = py[k]
            assert (u["mask"], u["version"], u["reward"], u["finish"]) == (
                v["mask"],
                v["version"],
                v["reward"],
                v["finish"],
            )
            np.testing.assert_allclose(u["logprobs"], v["logprobs"], rtol=0, atol=atol)


def _both_loops(
    backend: Any,
    env: Any,
    chat: Any,
    shape: TreeShape,
    limits: LoopLimits,
    n: int,
    inflight: int,
    tool_calls: str = "auto",
):
    tasks = env.tasks("train", n=n)
    lock = TreeSampler(backend, env, chat, shape, limits, loop="lockstep")
    a = lock.sample_trees(tasks, np.random.default_rng(0))
    run = TreeSampler(
        backend, env, chat, shape, limits, loop="async", max_inflight=inflight, tool_calls=tool_calls
    )
    b = run.sample_trees(tasks, np.random.default_rng(0))
    return a, b, run


@pytest.mark.parametrize("tool_calls", ["auto", "threads"])
def test_async_trees_equal_lockstep_trees_with_branches(
    kb_env: SyntheticKBEnv, tokenizer: Any, tool_calls: str
) -> None:
    """Tool calls on the event loop (auto: the KB's local index is a fast lookup) or in the thread pool:
    the same trees either way."""
    backend = SeededScripted(tokenizer)
    chat = ChatFormat.from_tokenizer(tokenizer)
    limits = LoopLimits(max_turns=4, max_turn_tokens=24, token_budget=400)
    a, b, run = _both_loops(backend, kb_env, chat, TreeShape(M=3, N=2), limits, 6, 4, tool_calls)
    assert run.inline_tools is (tool_calls == "auto")
    assert (run._tools is None) is (tool_calls == "auto")  # no pool was made for inline tool calls
    assert sum(t.num_leaves for t in a) > 6 * 3  # some branches were sampled: the comparison covers them
    assert_same_trees(a, b, atol=0.0)
    # 6 trees x 3 trajectories start at once: the bound holds them at 4 in flight
    assert run.stats["sampler/inflight_peak"] == 4.0
    assert 0 < run.stats["sampler/inflight_episodes"] <= 4.0
    server = run.turn_server()
    assert server.requests == run.stats["sampler/turns"] > server.batches  # turns gathered into batches


def test_async_trees_equal_lockstep_trees_on_the_hf_backend(kb_env: SyntheticKBEnv, tokenizer: Any) -> None:
    """The real model: the same ids; log-probs up to the float rounding of differently batched matmuls."""
    from actors.policy.hf_backend import HFBackend

    backend = HFBackend(build_tiny_model(tokenizer, seed=0), tokenizer, sampling=SamplingConfig(seed=0))
    chat = ChatFormat.from_tokenizer(tokenizer)
    limits = LoopLimits(max_turns=3, max_turn_tokens=12, token_budget=300)
    a, b, run = _both_loops(backend, kb_env, chat, TreeShape(M=3, N=2), limits, n=4, inflight=5)
    assert_same_trees(a, b, atol=1e-5)
    assert run.stats["sampler/inflight_peak"] == 5.0


def test_a_version_arriving_mid_episode_is_stamped_on_later_turns(
    kb_env: SyntheticKBEnv, tokenizer: Any
) -> None:
    searches = tuple(f"search: {w}" for w in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta"))
    backend = SeededScripted(tokenizer, menu=searches)  # every episode runs max_turns turns
    arrived = threading.Event()
    backend.on_call = lambda n: arrived.set() if n == 2 else None  # version 1 is published during call 2

    class Sink:
        delivered = False

        def poll(self, timeout_ms: int = 0) -> tuple[int, dict[str, Any]] | None:
            if self.delivered or not arrived.wait(min(timeout_ms / 1000, BOUND_S)):
                return None
            self.delivered = True
            return 1, {}

    chat = ChatFormat.from_tokenizer(tokenizer)
    limits = LoopLimits(max_turns=4, max_turn_tokens=24, token_budget=600)
    sampler = TreeSampler(backend, kb_env, chat, TreeShape(M=2, N=1), limits, weights=Sink(), max_inflight=8)
    trees = sampler.sample_trees(kb_env.tasks("train", n=2), np.random.default_rng(1))
    assert backend.version == 1 and sampler.stats["weights/applied"] == 1.0
    mixed = exact = 0
    for tree in trees:
        by_path = paths(tree)
        for k, node in by_path.items():
            ctx = [*tree.prompt_tokens.tolist()]
            for turn, obs in k[:-1]:
                ctx += [*turn, *obs]
            # each turn carries the version it was sampled with: 0 before the load, 1 after (a turn
            # whose context and ids another episode also sampled may have been sampled at either)
            seen = backend.seen[(tuple(ctx), k[-1][0])]
            assert node["version"] in seen
            exact += len(seen) == 1
        for leaf in tree.leaves:
            versions = [tree.nodes[i].policy_version for i in tree.path(leaf)]
            assert versions == sorted(versions)  # never an older version after a newer one
            mixed += 0 in versions and 1 in versions
    assert mixed > 0  # the version came mid-episode: some episodes have turns of both
    assert exact > 0
    assert sampler.stats["sampler/paused_for_weights_s"] >= sampler.stats["weights/apply_s"]


def test_auto_tool_calls_take_threads_for_a_retrieval_service(kb_env: SyntheticKBEnv, tokenizer: Any) -> None:
    """`sampler.tool_calls=auto`: the KB's own index is called on the event loop; the same env searching
    through the retrieval service (an HTTP client: it may block) gets the thread pool."""
    from actors.envs.retrieval_client import RetrievalClient

    remote = SyntheticKBEnv(kb=kb_env.kb, index=RetrievalClient("http://127.0.0.1:9"))  # never called
    chat, limits = ChatFormat.from_tokenizer(tokenizer), LoopLimits()
    backend = SeededScripted(tokenizer)
    assert (kb_env.inline_tools, remote.inline_tools) == (True, False)
    assert TreeSampler(backend, kb_env, chat, TreeShape(), limits).inline_tools is True
    assert TreeSampler(backend, remote, chat, TreeShape(), limits).inline_tools is False
    forced = TreeSampler(backend, remote, chat, TreeShape(), limits, tool_calls="inline")
    assert forced.inline_tools is True
    with pytest.raises(ValueError, match="tool_calls must be 'auto', 'inline' or 'threads', got 'fast'"):
        TreeSampler(backend, kb_env, chat, TreeShape(), limits, tool_calls="fast")
