"""Tokenizers with the conventions of real chat templates, built in-process for the protocol tests.

`qwen3_tokenizer()` is a byte-level BPE with Qwen3's special and added tokens (`<|im_start|>`, `<|im_end|>`
= eos, and `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`, `<think>`, `</think>` as
single non-special tokens) and a chat template written to Qwen3's conventions: the tool schemas in the
system message under "# Tools" when `tools=` is given, tool results as a user message of `<tool_response>`
blocks, the reasoning of earlier assistant messages dropped on re-rendering, and `enable_thinking=false`
writing an empty think block into the generation prompt. `thinking=True` gives the Qwen3-Thinking-2507
variant, whose generation prompt opens `<think>`. (transformers runs templates with trim_blocks, so a
newline right after a tag is written as an expression.)
"""

from __future__ import annotations

from typing import Any

ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

_TOOLS = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call functions. Their signatures, within <tools></tools>:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}\n</tools>\n\n"
    "Return each call as a JSON object with the function name and arguments within "
    "<tool_call></tool_call>:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
)
_MESSAGES = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}{% set c = m.content %}"
    "{% if '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n{{ c }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
)
_PROMPT = (
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
_PROMPT_THINKING = "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"

QWEN3_TEMPLATE = _TOOLS + _MESSAGES + _PROMPT
QWEN3_THINKING_TEMPLATE = _TOOLS + _MESSAGES + _PROMPT_THINKING

TEXTS = [
    'search answer query name arguments {"name": "search", "arguments": {"query": "Tavo Mirel mentor"}}',
    "The mentor of Tavo Mirel is Quinto Bel. Doc 1(Title: Paris) Paris is the capital of France.",
    "Answer the question. Use the tools as often as you need; call the answer tool with a short answer.",
    "I think the answer is Paris, so answer: Paris. Let me search first. information results functions",
] * 20


def qwen3_tokenizer(thinking: bool = False) -> Any:
    """A Qwen3-convention tokenizer (module docstring); the BPE is trained on TEXTS in well under 1 s."""
    from actors.policy.tiny_model import build_tokenizer

    tok = build_tokenizer(TEXTS, vocab_size=600)
    tok.add_tokens(list(ADDED))  # single tokens, not special (as in Qwen3's tokenizer)
    tok.chat_template = QWEN3_THINKING_TEMPLATE if thinking else QWEN3_TEMPLATE
    return tok


def chatml_tokenizer() -> Any:
    """A ChatML tokenizer that ignores `tools=` and has no `<tool_call>` token (SmolLM2's conventions)."""
    from actors.policy.tiny_model import build_tokenizer

    return build_tokenizer(TEXTS, vocab_size=600)
