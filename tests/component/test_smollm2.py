"""SmolLM2-135M-Instruct, a real model with its own chat template (ChatML that ignores `tools=` and has no
`<tool_call>` token): `treeopsd model import` converts its GGUF, the protocols render exactly what its
template renders, and the issue's evaluation command reports pass@1 and pass@4 on FlashRAG over wiki-18."""

from __future__ import annotations

import json

import fixtures_data as fx
import pytest
from real_model_fixtures import smollm2_folder

from actors.envs import make_env
from actors.envs.tool_calls import ToolCall
from actors.protocols import make_protocol
from actors.protocols.qwen3 import template_handles_tools
from launch.cli import main

pytestmark = pytest.mark.slow  # the first use imports the GGUF (~30 s); later runs reuse the folder

CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>'


@pytest.fixture(scope="module")
def folder():
    return smollm2_folder()


def test_protocols_render_what_smollm2s_template_renders(folder, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    env = make_env("multihop_qa", corpus=fx.write_wiki18(tmp_path), topk=1)
    assert not template_handles_tools(tok, env.tool_schemas())  # SmolLM2's template drops tools=
    assert make_protocol("auto", tok, env).name == "plain"
    p = make_protocol("qwen3", tok, env)
    assert p.stop_strings == ("</tool_call>",) and p.stop_token_ids == (tok.eos_token_id,)
    [system, user] = p.prompt_messages(p.system_prompt(env), "Which city is the capital of France?")
    assert '"name": "search"' in system["content"]  # the schemas went into the system message instead
    msgs = [system, user]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    prompt_ids = p.initial_context(p.system_prompt(env), user["content"])
    assert prompt_ids == tok.encode(prompt, add_special_tokens=False)  # the template's own rendering
    sampled = tok.encode(CALL, add_special_tokens=False)  # what the model emits; it stops on the string
    obs = env.search("capital of France")
    assert obs.startswith("Doc 1(Title: Paris)")
    ids = p.observation_tokens(obs, sampled)
    assert tok.decode(ids) == f"<|im_end|>\n<|im_start|>tool\n{obs}<|im_end|>\n<|im_start|>assistant\n"
    full = [*msgs, {"role": "assistant", "content": CALL}, {"role": "tool", "content": obs}]
    text = tok.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
    assert [*prompt_ids, *sampled, *ids] == tok.encode(text, add_special_tokens=False)  # token for token
    r1 = make_protocol("search_r1", tok, env)
    assert r1.stop_strings == ("</search>", "</answer>")
    assert r1.parse("<search> capital of France </search>") == ToolCall(
        "search", {"query": "capital of France"}, "<search> capital of France </search>"
    )


def test_import_then_eval_search_r1_with_samples(folder, tmp_path, capsys):
    data, corpus = fx.write_flashrag(tmp_path), fx.write_wiki18(tmp_path)
    argv = [
        "eval",
        "--model",
        str(folder),
        "--data",
        str(data),
        "env.name=multihop_qa",
        f"env.corpus={corpus}",
    ]
    opts = ["env.protocol=search_r1", "--samples", "4", "--json", "env.max_turns=2", "logging.progress=false"]
    assert main([*argv, *opts]) == 0
    report = json.loads(capsys.readouterr().out)
    r = report["datasets"]["hotpotqa"]
    assert report["n"] == 2 and r["samples"] == 4 and r["sampled"]["n"] == 8  # 2 questions x 4 samples
    assert 0.0 <= r["sampled_success"] <= r["pass_at_k"] <= 1.0  # pass@1 (estimate) <= pass@4
    assert sum(r["sampled"]["finish"].values()) == 8 and sum(r["finish"].values()) == 2
