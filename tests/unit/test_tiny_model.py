"""Tiny tokenizer + Qwen2 model: byte-exact round trips, ChatML template, reload fidelity, head_dim 32."""

from __future__ import annotations

import unicodedata

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.policy.tiny_model import (
    CHATML_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    build_tiny_model,
    build_tokenizer,
    load_model,
    save_tiny,
)

TEXTS = [
    "The birthplace of Tavo Mirel is Quinto.",
    "The employer of Tavo Mirel is Brask Labs.",
    "Use search: <query> or answer: <answer>.",
    "What is the capital of the country of the birthplace of Tavo Mirel?",
    "search: Tavo Mirel birthplace",
] * 40

ODD_TEXTS = [
    "",
    " ",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\n",
    "héllo wörld — 世界 🙂 ﬁ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "bytes \x00\x01\x7f and 's 't 're",
    "Never seen: Zyxqwv 123456789 !!! ??? ...",
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TEXTS, vocab_size=512)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), TEXTS, seed=3)


def test_special_token_ids_and_names(tok):
    assert [tok.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    assert tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT
    assert tok.encode(IM_START + IM_END, add_special_tokens=False) == [1, 2]  # specials stay single tokens


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_round_trip_is_byte_exact(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_round_trip_random_unicode(tok):
    # Any NFC text (the Qwen2 pipeline normalizes to NFC, see build_tokenizer) comes back byte for byte.
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        cps = torch.randint(1, 0x2FFFF, (40,), generator=g).tolist()
        text = "".join(chr(c) for c in cps if not 0xD800 <= c <= 0xDFFF)
        text = unicodedata.normalize("NFC", text)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_task_words_are_compressed(tok):
    # Trained on the task text: a frequent sentence must be far fewer tokens than bytes.
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    assert len(ids) < len(TEXTS[0]) / 3


def test_chat_template_is_chatml(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_template == CHATML_TEMPLATE


def test_model_shape_and_head_dim(tok):
    model = build_tiny_model(tok)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 1)
    assert (
        cfg.head_dim == 32 and cfg.hidden_size // cfg.num_attention_heads == 32
    )  # vLLM CPU needs 32/64/80..
    assert cfg.vocab_size == len(tok) and cfg.tie_word_embeddings
    assert cfg.eos_token_id == 2 and cfg.pad_token_id == 0
    n_params = sum(p.numel() for p in model.parameters())
    assert 50_000 < n_params < 300_000


def test_seed_fixes_weights(tok):
    a, b, c = build_tiny_model(tok, seed=1), build_tiny_model(tok, seed=1), build_tiny_model(tok, seed=2)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])


def test_folder_reloads_with_identical_logits_and_ids(folder):
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    assert not any(n.endswith((".bin", ".pkl", ".pt")) for n in names)  # no pickle anywhere
    model, tok = load_model(folder)
    auto_model = AutoModelForCausalLM.from_pretrained(folder)
    auto_tok = AutoTokenizer.from_pretrained(folder)
    text = "The birthplace of Tavo Mirel is Quinto. héllo\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert auto_tok.encode(text, add_special_tokens=False) == ids  # the loader vLLM uses agrees
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(x).logits, auto_model(x).logits)
    assert model.dtype == torch.float32 and not model.training


def test_saved_folder_matches_built_tokenizer(folder, tok):
    _, reloaded = load_model(folder)
    fresh = build_tokenizer(TEXTS)  # save_tiny uses the default vocab size
    for text in [*ODD_TEXTS, *TEXTS[:5]]:
        assert reloaded.encode(text, add_special_tokens=False) == fresh.encode(text, add_special_tokens=False)
    msgs = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n"
    )


def test_gguf_path_needs_the_optional_package(tmp_path):
    try:
        import gguf  # noqa: F401

        pytest.skip("gguf installed; the guard is not exercised")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="gguf"):
        load_model(tmp_path / "model.gguf")
