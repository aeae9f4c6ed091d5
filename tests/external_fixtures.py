"""Shared set-up of the external-agent tests: a scripted backend that writes Qwen3 tool calls, the small
synthetic KB and its qwen3 protocol, and a TreeSampler over a harness through a real endpoint."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from actors.agent_loop import LoopLimits
from actors.envs.synthetic_kb import KBConfig, SyntheticKBEnv, tokenizer_texts
from actors.external.endpoint import AgentEndpoint
from actors.external.openai_format import SamplingBounds
from actors.external.render import Templates
from actors.external.trees import ExternalTrees, HarnessLimits
from actors.policy.tiny_model import build_tokenizer
from actors.protocols import bind_protocol
from actors.tree_sampler import TreeSampler, TreeShape
from configs.schema import load_config
from system.policy import SampleRequest, SampleResult
from tests.fakes import TextBackend


def kb_setup():
    """(env under the qwen3 protocol, protocol, tokenizer) over a small synthetic KB."""
    env = SyntheticKBEnv(config=KBConfig(n_persons=40, n_companies=10, n_cities=12, n_countries=5))
    tok = build_tokenizer(tokenizer_texts(env, n_questions=200, n_oracle=20))
    cfg = load_config(overrides=["env.protocol=qwen3"])
    protocol, penv = bind_protocol(cfg.env, tok, env)
    return penv, protocol, tok


def call_text(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ToolScript(TextBackend):
    """PolicyBackend that searches once, then answers (right or wrong, by the request's seed): real token ids
    of the tokenizer, log-probs drawn from the seed. The first turn stops at `</tool_call>` (no end-of-turn
    token, as a stop string leaves it), the answer turn ends with the end-of-turn token."""

    def __init__(self, tokenizer, tasks, think: bool = False) -> None:
        self.tok, self.tasks, self.think = tokenizer, list(tasks), think
        self.version = 0
        self.eot = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.results: list[SampleResult] = []  # every turn it sampled, in order

    def text(self, req: SampleRequest, rng: np.random.Generator) -> tuple[str, bool]:
        context = self.tok.decode(list(req.context))
        task = next(t for t in self.tasks if t.question in context)
        turn = context.count("<|im_start|>assistant") - 1
        lead = "<think>let me look</think>" if self.think else ""
        if turn == 0:
            return lead + call_text("search", query=f"{task.meta['chain'][0]} {task.meta['path'][0]}"), False
        answer = task.answers[0] if rng.random() < 0.5 else "nobody"
        return lead + call_text("answer", answer=answer), True

    def sample(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        out = []
        for req in requests:
            rng = np.random.default_rng(req.seed)
            text, closed = self.text(req, rng)
            ids = [*self.tok.encode(text, add_special_tokens=False), *([self.eot] if closed else [])]
            res = SampleResult(ids, (-rng.random(len(ids))).tolist(), "stop")
            self.results.append(res)
            out.append(res)
        return out


def external_sampler(
    backend,
    env,
    protocol,
    harness,
    shape=(2, 1),
    token=None,
    store=None,
    tasks=(),
    side_calls="train",
    **limits,
) -> TreeSampler:
    """A TreeSampler whose trees come from `harness` through a fresh loopback endpoint (`store` and `tasks`
    for `sample_and_commit`; `timeout_s`, `reward_timeout_s`, `max_failures`: the harness's limits;
    `tool_change`, `agent_wait_s`: env.tool_change, env.agent_wait_s)."""
    harness_limits = HarnessLimits(
        limits.pop("timeout_s", 30.0), limits.pop("reward_timeout_s", 2.0), limits.pop("max_failures", 32)
    )
    tool_change, agent_wait_s = limits.pop("tool_change", "refuse"), limits.pop("agent_wait_s", 10.0)
    loop_limits = LoopLimits(**{"max_turns": 4, "max_turn_tokens": 64, "token_budget": 1200, **limits})
    endpoint = AgentEndpoint(token=token, agent_wait_s=agent_wait_s)
    bounds = SamplingBounds(1.0, 1.0)
    ext = ExternalTrees(
        harness, endpoint, Templates(protocol), bounds, harness_limits, None, side_calls, tool_change
    )
    M, N = shape
    return TreeSampler(
        backend, env, protocol, TreeShape(M=M, N=N), loop_limits, external=ext, store=store, tasks=tasks
    )


def worst_rescore_gap(trees, score) -> float:
    """The largest |re-scored − stored| log-prob over every sampled token of `trees`: each turn re-scored by
    `score(context, start)` after its exact stored context (prompt, earlier turns, observations)."""
    worst = 0.0
    for t in trees:
        for leaf in t.leaves:
            ids = t.prompt_tokens.tolist()
            for i in t.path(leaf):
                n = t.nodes[i]
                start, ids = len(ids), [*ids, *n.tokens.tolist()]
                worst = max(worst, float(np.abs(np.array(score(ids, start)) - n.behavior_logprobs).max()))
                ids += n.obs_tokens.tolist()
    return worst


def broken_harness(task, base_url, session):
    """A harness that fails every episode (before any request): `treeopsd train` must stop on it."""
    raise RuntimeError("the harness broke")


def counted_harness(task, base_url, session):
    """A harness whose `external/*` counts are known per tree of M = 2 trunks (no branches: one main turn per
    episode leaves no anchor): trunk m1 raises before any request (1 episode dropped, a harness error); m0
    asks one main turn, one judge (a side call: 1 side tree), one request with a forged key (1 rejected
    before any session), posts its reward twice (the second a 409: 1 double reward) and returns None."""
    import httpx
    import openai

    if session.endswith("/m1"):
        raise RuntimeError("trunk m1 gives up")
    client = openai.OpenAI(base_url=base_url, api_key=task["api_key"], max_retries=0)
    msgs = [
        {"role": "system", "content": task["system_prompt"]},
        {"role": "user", "content": task["question"]},
    ]
    client.chat.completions.create(model="policy", messages=msgs, tools=task["tools"])
    judge = [{"role": "user", "content": f"Judge the answer to: {task['question']}"}]
    client.chat.completions.create(model="policy", messages=judge)
    forged = task["api_key"].rsplit(".", 1)[0] + "." + "0" * 64
    assert httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {forged}"}).status_code == 401
    key = {"Authorization": f"Bearer {task['api_key']}"}
    posts = [httpx.post(f"{base_url}/reward", json={"reward": 1.0}, headers=key) for _ in range(2)]
    assert [p.status_code for p in posts] == [200, 409]
    return None
