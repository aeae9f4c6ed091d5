"""Shared set-up of the external-agent tests: a scripted backend that writes Qwen3 tool calls, the small
synthetic KB and its qwen3 protocol, and a TreeSampler over a harness through a real endpoint."""

from __future__ import annotations

import functools
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


def worst_rescore_gap(trees, score, version=None) -> float:
    """The largest |re-scored − stored| log-prob over every sampled token of `trees` (of the turns `version`
    sampled, if given): each turn re-scored by `score(context, start)` after its exact stored context
    (prompt, earlier turns, observations; from the nearest restart: a compaction's context)."""
    worst = 0.0
    for t in trees:
        for leaf in t.leaves:
            for run in t.context_runs(int(leaf)):
                ids = []
                for i in run:
                    n = t.nodes[i]
                    start, ids = len(ids), [*ids, *n.tokens.tolist()]
                    if len(n.tokens) and (version is None or n.policy_version == version):
                        gap = np.abs(np.array(score(ids, start)) - n.behavior_logprobs).max()
                        worst = max(worst, float(gap))
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


def ending_turns(model, eos: int, bias: float = 8.0, gain: float = 0.75):
    """The tiny random model made to end its turns: P(end of turn) ≈ 0.25 at every position, whatever the
    context (a random model otherwise writes until `env.max_turn_tokens` cuts it, which ends its
    conversation). The last layer's attention adds the constant `bias` to residual dimension 0 (a value bias
    passes through attention unchanged: its weights sum to 1), which no other weight writes or reads but the
    end-of-turn token's (tied) embedding, at `gain`."""
    import torch

    with torch.no_grad():
        emb = model.model.embed_tokens.weight  # tied with lm_head
        emb[:, 0] = 0.0
        emb[eos, 0] = gain
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        attn = model.model.layers[-1].self_attn
        attn.v_proj.weight[0, :] = 0.0
        attn.v_proj.bias[0] = bias
        attn.o_proj.weight[0, 0] = 1.0  # query head 0 reads value dimension 0 of key-value head 0
    return model


def ending_model_dir(folder) -> str:
    """A tiny model folder (the synthetic KB's tokenizer) whose turns end (`ending_turns`)."""
    from actors.policy.tiny_model import build_tiny_model, save_pretrained

    tok = build_tokenizer(tokenizer_texts(SyntheticKBEnv(), n_questions=300, n_oracle=30))
    model = ending_turns(build_tiny_model(tok, seed=0), tok.convert_tokens_to_ids(tok.eos_token))
    save_pretrained(folder, model, tok)
    return str(folder)


SUMMARY_PROMPT = "Summarise the conversation below for whoever continues it."


def long_context_harness(task, base_url, session):
    """An agent with a long context, deterministic given the model's replies (any model: no tool needed).
    Main turn 1; a sub-agent (a fresh conversation) whose reply is fed back to the main conversation in
    the next request; main turn 2; a summary of the transcript; the history compacted to the question and
    that summary, and 2 more turns there; then a judge (the same prompt in every episode: a side tree of
    many leaves) and a title of the transcript (its own prompt: a side tree of one leaf). A cut turn ends
    its conversation: before the compaction the harness compacts at once, after it the episode is over.
    The reward: whether the last reply's text has an even length (a function of the replies)."""
    import openai

    c = openai.OpenAI(base_url=base_url, api_key=task["api_key"], max_retries=0)
    ask = functools.partial(_reply, c)
    system = {"role": "system", "content": task["system_prompt"]}
    msgs = [system, {"role": "user", "content": task["question"]}]
    main = ask(msgs, task["tools"])
    if main is not None:
        found = ask([{"role": "system", "content": "You are a research assistant."}, msgs[1]])
        msgs += [main, *_answers(main, f"Go on. A sub-agent found:\n{_text(found)}")]
        main = ask(msgs, task["tools"])
        msgs += [main] if main is not None else []
    summary = ask(
        [{"role": "system", "content": SUMMARY_PROMPT}, {"role": "user", "content": _transcript(msgs)}]
    )
    msgs = [system, {"role": "user", "content": f"{task['question']}\nNotes:\n{_text(summary)}"}]
    last = None
    for _ in range(2):
        last = ask(msgs, task["tools"])
        if last is None:
            break
        msgs += [last, *_answers(last, "Go on.")]
    ask([{"role": "user", "content": f"Judge the answer to: {task['question']}"}])
    ask([{"role": "user", "content": f"A title for: {_transcript(msgs)}"}])
    return float(len(_text(last)) % 2 == 0)


def _reply(client, messages, tools=None):
    """The reply message as it must be sent back, or None when the turn was cut (or refused: a limit)."""
    import openai

    try:
        r = client.chat.completions.create(
            model="policy", messages=messages, **({"tools": tools} if tools else {})
        )
    except openai.BadRequestError:
        return None
    choice = r.choices[0]
    return None if choice.finish_reason == "length" else choice.message.model_dump(exclude_none=True)


def _text(message) -> str:
    return (message or {}).get("content") or ""


def _answers(message, then: str) -> list:
    """Tool messages for the calls of `message` (the model may write some), then a user message."""
    calls = message.get("tool_calls") or []
    return [
        *({"role": "tool", "tool_call_id": t["id"], "content": "no result"} for t in calls),
        {"role": "user", "content": then},
    ]


def _transcript(messages) -> str:
    return "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages[1:])
