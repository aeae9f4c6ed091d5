"""Agent protocols on tokenizers with real templates' conventions (tests/protocol_fixtures.py): the first
prompt is the template's own rendering with `tools=`, later turns store exactly the sampled ids plus the
template's rendering of the observation, nested JSON arguments parse, nothing inside the reasoning is a
call or an answer, and turns stop at `</tool_call>` (a token) or at stop strings (no such token)."""

from __future__ import annotations

import json

import pytest
from protocol_fixtures import chatml_tokenizer, qwen3_tokenizer

from actors.agent_loop import Episode, LoopLimits, run_episodes
from actors.chat import ChatFormat
from actors.envs.synthetic_kb import SyntheticKBEnv
from actors.envs.tool_calls import ParseError, ToolCall
from actors.protocols import ProtocolEnv, make_protocol
from actors.protocols.qwen3 import SYSTEM_PROMPT as QWEN3_PROMPT
from system.policy import SampleResult
from system.tree_build import TreeBuilder

CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "mentor"}}\n</tool_call>'
ANSWER = '<tool_call>\n{"name": "answer", "arguments": {"answer": "Quinto"}}\n</tool_call>'
QWEN3_TOOL_TURN = (
    "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def env():
    return SyntheticKBEnv()


@pytest.fixture(scope="module")
def qtok():
    return qwen3_tokenizer()


class Scripted:
    """A backend that returns the given turns (as ids) in order and records every request."""

    def __init__(self, turns):
        self.turns, self.requests, self.version = list(turns), [], 0

    def sample(self, requests):
        self.requests += list(requests)
        out = []
        for _ in requests:
            ids = list(self.turns.pop(0))
            out.append(SampleResult(ids, [-0.5] * len(ids), "stop"))
        return out


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_plain_is_chatformat_on_the_tiny_chatml_tokenizer(env):
    tok = chatml_tokenizer()
    plain, chat = make_protocol("plain", tok, env), ChatFormat.from_tokenizer(tok)
    assert plain.initial_context(env.system_prompt(), "Who?") == chat.initial_context(
        env.system_prompt(), "Who?"
    )
    turn = [*enc(tok, "search: x"), tok.eos_token_id]
    assert plain.observation_tokens("The mentor of A is B.", turn) == chat.observation_tokens(
        "The mentor of A is B."
    )
    assert plain.stop_token_ids == chat.stop_token_ids == (tok.eos_token_id,) and plain.stop_strings == ()
    assert plain.parse("search: Tavo mentor") == ToolCall(
        "search", {"query": "Tavo mentor"}, "search: Tavo mentor"
    )
    assert make_protocol("auto", tok, env).name == "plain"  # ChatML ignores tools=


def test_an_observation_seen_again_is_encoded_once_and_the_same(env, qtok):
    proto = make_protocol("qwen3", qtok, env)
    turn = [*enc(qtok, "<tool_call>{}</tool_call>"), proto.eot_id]  # closed: no <|im_end|> lead
    before = proto._encode_cached.cache_info()
    first = proto.observation_tokens("The mentor of A is B.", turn)
    first.append(-1)  # the caller owns its list: the cached ids are not touched
    again = proto.observation_tokens("The mentor of A is B.", turn)
    info = proto._encode_cached.cache_info()
    assert (info.hits - before.hits, info.misses - before.misses) == (1, 1)  # encoded once, served once
    assert again == enc(qtok, QWEN3_TOOL_TURN.format("The mentor of A is B."))


def test_qwen3_first_prompt_is_the_templates_rendering_with_tools(env, qtok):
    p = make_protocol("qwen3", qtok, env)
    assert make_protocol("auto", qtok, env).name == "qwen3"
    msgs = [{"role": "system", "content": QWEN3_PROMPT}, {"role": "user", "content": "Who?"}]
    text = qtok.apply_chat_template(
        msgs, tools=env.tool_schemas(), tokenize=False, add_generation_prompt=True
    )
    assert p.initial_context(p.system_prompt(env), "Who?") == enc(qtok, text)
    assert text.startswith(f"<|im_start|>system\n{QWEN3_PROMPT}\n\n# Tools\n")
    assert '{"type": "function", "function": {"name": "search"' in text and text.endswith(
        "<|im_start|>assistant\n"
    )
    off = make_protocol("qwen3", qtok, env, enable_thinking=False)  # Qwen3: an empty think block
    assert qtok.decode(off.initial_context("s", "u")).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_qwen3_turns_store_sampled_ids_plus_the_rendered_observation(env, qtok):
    p = make_protocol("qwen3", qtok, env)
    close = qtok.convert_tokens_to_ids("</tool_call>")
    assert p.stop_token_ids == tuple(sorted((qtok.eos_token_id, close))) and p.stop_strings == ()
    task = env.tasks("train", n=1, hops=(2, 2))[0]
    first, second = enc(qtok, CALL), enc(qtok, ANSWER)
    assert first[-1] == close and second[-1] == close  # the turn's stop token is the call's close
    backend = Scripted([first, second])
    agent_env = ProtocolEnv(env, p)
    prompt = p.initial_context(agent_env.system_prompt(), agent_env.user_prompt(task))
    b = TreeBuilder("t", prompt)
    ep = Episode(task, b, 0, b.context_tokens(0), [], 0, key="e")
    run_episodes([ep], backend, agent_env, p, LoopLimits(max_turns=4, max_turn_tokens=64, token_budget=2048))
    assert ep.finish == "answer" and len(ep.nodes) == 2
    assert backend.requests[0].stop_token_ids == p.stop_token_ids
    tree = b.build()
    node = tree.nodes[ep.nodes[0]]
    assert list(node.tokens) == first  # exactly the sampled ids
    obs_text = env.search("mentor")
    # the turn stopped at </tool_call>, so the observation closes it with <|im_end|> first (hand-worked)
    assert list(node.obs_tokens) == enc(qtok, "<|im_end|>" + QWEN3_TOOL_TURN.format(obs_text))
    # and prompt + sampled + observation is token for token the template's rendering of the conversation
    msgs = [
        {"role": "system", "content": QWEN3_PROMPT},
        {"role": "user", "content": task.question},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": obs_text},
    ]
    full = qtok.apply_chat_template(
        msgs, tools=env.tool_schemas(), tokenize=False, add_generation_prompt=True
    )
    assert b.context_tokens(ep.nodes[0]) == enc(qtok, full)
    closed = [*enc(qtok, "search: x"), qtok.eos_token_id]  # a turn that ended with <|im_end|> itself
    assert p.observation_tokens("R", closed) == enc(qtok, QWEN3_TOOL_TURN.format("R"))


def test_a_call_with_nested_json_arguments_parses(env, qtok):
    p = make_protocol("qwen3", qtok, env)
    args = {"query": "Paris", "filters": {"years": [2019, 2020], "site": {"lang": "en", "strict": True}}}
    call = p.parse(
        'Let me look.\n<tool_call>\n{"name": "search", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
    )
    assert isinstance(call, ToolCall) and call.name == "search" and call.arguments == args
    step = ProtocolEnv(env, p).step(env.tasks("train", n=1)[0], [], p.action_text(call))
    assert (
        (step.call.name, step.call.arguments) == ("search", args)
        and not step.done
        and step.observation == env.search("Paris")
    )
    bad = p.parse('<tool_call>{"name": "search", "arguments": {"query": "x"</tool_call>')
    assert isinstance(bad, ParseError) and bad.attempted  # malformed JSON: an error observation, not the end
    deep = ProtocolEnv(env, p).step(env.tasks("train", n=1)[0], [], "<tool_call>" + "[" * 5000)
    assert not deep.done and deep.observation == "error: invalid JSON in <tool_call>: nested too deeply"
    stringly = p.parse('<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>')
    assert stringly.arguments == {"query": "x"}  # string-encoded arguments (some models write them so)


def test_nothing_inside_reasoning_is_a_call_or_an_answer(env):
    thinking = qwen3_tokenizer(thinking=True)  # the generation prompt opens <think> (Thinking-2507)
    p = make_protocol("qwen3", thinking, env)
    assert p.rendering.opens_think
    task = env.tasks("train", n=1)[0]
    agent_env = ProtocolEnv(env, p)
    inside = "The answer: Quinto, I guess.\n<answer>Quinto</answer>\n" + CALL  # no </think>: all reasoning
    res = agent_env.step(task, [], inside)
    assert not res.done and res.call is None and res.info["error"] == "malformed_call"  # nothing executed
    assert res.observation.startswith("error: a <tool_call> inside the reasoning")
    after = agent_env.step(task, [], "answer: Quinto <tool_call>\n</think>\n\n" + CALL)
    assert after.call.arguments == {"query": "mentor"} and not after.done
    plain = ProtocolEnv(env, make_protocol("plain", thinking, env))
    ended = plain.step(task, [], "answer: Quinto")  # still inside the reasoning the prompt opened
    assert ended.info["finish"] == "malformed" and ended.reward == 0.0 and "answer" not in ended.info
    r1 = ProtocolEnv(env, make_protocol("search_r1", qwen3_tokenizer(), env))
    hidden = r1.step(task, [], "<think>so <answer>Quinto</answer>?</think>\n<search> mentor </search>")
    assert hidden.call.arguments == {"query": "mentor"} and not hidden.done
    assert p.action_ids(ToolCall("search", {"query": "q"}))[: len(enc(thinking, "</think>"))] == enc(
        thinking, "</think>"
    )  # the SFT target closes the reasoning before calling


def test_qwen3_on_a_template_without_tools_and_without_a_close_token(env):
    tok = chatml_tokenizer()  # SmolLM2's conventions: tools= ignored, no <tool_call> token
    p = make_protocol("qwen3", tok, env)
    assert p.stop_strings == ("</tool_call>",) and p.stop_token_ids == (tok.eos_token_id,)
    text = tok.decode(p.initial_context(p.system_prompt(env), "Who?"))
    assert "# Tools" in text and '"name": "search"' in text  # the schemas went into the system message
    ids = p.action_ids(ToolCall("search", {"query": "q"}))
    assert tok.decode(ids).endswith("</tool_call>") and ids[-1] != tok.eos_token_id
    obs = p.observation_tokens("R", ids)  # stopped on the string: the observation closes the turn
    assert tok.decode(obs) == "<|im_end|>\n<|im_start|>tool\nR<|im_end|>\n<|im_start|>assistant\n"


def test_search_r1_tags_and_information_block(env):
    tok = chatml_tokenizer()
    p = make_protocol("search_r1", tok, env)
    assert p.stop_strings == ("</search>", "</answer>")
    assert p.parse("<think>hmm</think>\n<search> Tavo mentor </search>") == ToolCall(
        "search", {"query": "Tavo mentor"}, "<search> Tavo mentor </search>"
    )
    assert p.parse("<answer> Quinto </answer>").arguments == {"answer": "Quinto"}
    assert isinstance(p.parse("I do not know"), ParseError)
    turn = p.action_ids(ToolCall("search", {"query": "q"}))
    assert tok.decode(turn) == "<search> q </search>"
    assert tok.decode(p.observation_tokens("Doc 1", turn)) == "\n\n<information>Doc 1</information>\n\n"
    assert "<search> query </search>" in p.system_prompt(env)


def test_require_search_gates_an_answer_given_before_any_search(env, qtok):
    p = make_protocol("qwen3", qtok, env)
    task = env.tasks("train", n=1)[0]
    answer = f'<tool_call>{{"name": "answer", "arguments": {{"answer": "{task.answers[0]}"}}}}</tool_call>'
    assert ProtocolEnv(env, p).step(task, [], answer).reward == 1.0
    gated = ProtocolEnv(env, p, require_search=True).step(task, [], answer)
    assert gated.reward == 0.0 and gated.info["em"] == 1.0 and gated.info["gated"] == "no_search"
    after = ProtocolEnv(env, p, require_search=True).step(task, [ToolCall("search", {"query": "q"})], answer)
    assert after.reward == 1.0


def test_f1_reward_gives_partial_credit_in_training_and_evaluation_still_scores_em(env, qtok):
    from actors.protocols import bind_protocol
    from configs.schema import load_config

    task = env.tasks("train", n=1)[0]
    gold = task.answers[0]
    assert len(gold.split()) == 1  # a one-word entity name: the arithmetic below relies on it
    answer = f'<tool_call>{{"name": "answer", "arguments": {{"answer": "{gold} city"}}}}</tool_call>'
    env_cfg = load_config(overrides=["env.reward=f1"]).env
    _, training = bind_protocol(env_cfg, qtok, env)
    step = training.step(task, [], answer)
    # prediction "<gold> city" against "<gold>": precision 1/2, recall 1, F1 = 2·(1/2)·1 / (3/2) = 2/3; EM 0
    assert step.reward == pytest.approx(2 / 3) and step.info["em"] == 0.0
    _, evaluation = bind_protocol(env_cfg, qtok, env, evaluation=True)
    assert evaluation.step(task, [], answer).reward == 0.0  # success stays EM whatever env.reward says
    _, default = bind_protocol(load_config().env, qtok, env)
    assert default.step(task, [], answer).reward == 0.0
