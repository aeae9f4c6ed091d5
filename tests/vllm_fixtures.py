"""Session fixtures for vLLM tests: a self-contained tiny Qwen2 folder and ONE shared engine.

Engine start costs 20–60 s on the 2-core CI machine, so every vLLM test in a pytest session shares the
`vllm_backend` fixture (tests that change weights must restore them). Import the fixtures into a test module:

    from tests.vllm_fixtures import tiny_model_dir, vllm_backend  # noqa: F401

The tiny model is built here on purpose (not from actors/policy/tiny_model.py) so these tests only depend on
transformers/tokenizers/vllm.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "zen", "qua", "tree", "turn", "tool")

# Recorded by the fixtures, printed by the tests that measure things.
MEASUREMENTS: dict[str, float] = {}


def _corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    """Generated text with enough variety for ~1000 BPE merges (syllable words, numbers, punctuation)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = [
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
            for _ in range(rng.randint(6, 18))
        ]
        words.insert(rng.randrange(len(words)), f"{rng.randint(0, 99999)}")
        lines.append(f"<|im_start|>user {' '.join(words)}, line {i}? ok.<|im_end|>")
    return lines


def build_tokenizer(out_dir: Path) -> Any:
    """ByteLevel BPE (vocab <= VOCAB_SIZE) wrapped in PreTrainedTokenizerFast, eos `<|im_end|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Tokenizer + random Qwen2 (hidden 64, 2 layers, head_dim 32, tied embeddings) saved as safetensors."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # type: ignore[call-arg]  # the CPU attention kernels reject 16
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# A module that takes these fixtures (`vllm_backend = vllm_fixtures.vllm_backend`) registers fixtures of its
# own: pytest keeps one value per registration, so two modules would build two models and start two engines.
# The values live here instead, once per process; the first registration to finish closes the engine.
_SHARED: dict[str, Any] = {}
# The LoRA engine runs eager: vLLM's torch.compile of the graph took 35 s of an engine's start against 18 s
# eager, for the same decode speed on this model. The base engine compiles, as users' engines do, so that
# loading weights in place under a compiled graph stays tested (test_vllm_backend.py).
EAGER = {"enforce_eager": True}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "model" not in _SHARED:
        _SHARED["model"] = build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))
    return Path(_SHARED["model"])


@pytest.fixture(scope="session")
def vllm_backend(tiny_model_dir: Path) -> Iterator[Any]:
    """The one engine of the session (float32, prefix caching on, seeded, compiled)."""
    from actors.policy.vllm_backend import VLLMBackend

    if "backend" not in _SHARED:
        t0 = time.perf_counter()
        _SHARED["backend"] = VLLMBackend(str(tiny_model_dir), dtype="float32", max_model_len=1024, seed=1234)
        MEASUREMENTS["engine_start_s"] = time.perf_counter() - t0
        print(f"\n[vllm] engine start {MEASUREMENTS['engine_start_s']:.1f} s")
    try:
        yield _SHARED["backend"]
    finally:
        if (backend := _SHARED.pop("backend", None)) is not None:
            backend.close()


LORA_RANK = 4  # the LoRA engine's adapters (tests/component/test_vllm_lora.py); its max_lora_rank is 8


@pytest.fixture(scope="session")
def vllm_lora_backend(tiny_model_dir: Path) -> Iterator[Any]:
    """The session's one LoRA engine (`lora_rank`: enable_lora, max_lora_rank 8, max_loras 2), else as
    `vllm_backend`; a module of its own, so a run of the LoRA tests alone starts this engine only."""
    from actors.policy.vllm_backend import VLLMBackend

    if "lora_backend" not in _SHARED:
        t0 = time.perf_counter()
        _SHARED["lora_backend"] = VLLMBackend(
            str(tiny_model_dir),
            dtype="float32",
            max_model_len=1024,
            seed=1234,
            extra_engine_args=EAGER,
            lora_rank=LORA_RANK,
        )
        MEASUREMENTS["lora_engine_start_s"] = time.perf_counter() - t0
    try:
        yield _SHARED["lora_backend"]
    finally:
        if (backend := _SHARED.pop("lora_backend", None)) is not None:
            backend.close()
