"""The tokenizers library's own `encode`, called straight, where transformers' wrapper adds nothing to it.

The sampler encodes every tool observation on its event loop (`AgentProtocol.observation_tokens`), and for a
fast tokenizer `tokenizer.encode(text, add_special_tokens=False)` is the Rust tokenizer's `encode_batch` on
a one-text batch, after switching the backend's truncation and padding off and its `encode_special_tokens`
to the wrapper's `split_special_tokens`, with input checks and a `BatchEncoding` around it: about half of
the call's time. `direct_encoder` returns the bare Rust call for exactly that case (a `TokenizersBackend`
whose `encode` and `_encode_plus` are the library's own), and the call returns None, for the caller to use
the wrapper, whenever the backend is not in the state the wrapper would put it in (someone truncated or
padded through it, or changed `split_special_tokens`): the same ids either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DirectEncode = Callable[[str], "list[int] | None"]


def direct_encoder(tokenizer: Any) -> DirectEncode | None:
    """A text -> ids function equal to `tokenizer.encode(text, add_special_tokens=False)`, or None where
    that cannot be promised (a slow tokenizer, or a subclass with its own encoding)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the wrapper it is
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    own_encode = cls.encode is not PreTrainedTokenizerBase.encode
    if own_encode or cls._encode_plus is not TokenizersBackend._encode_plus:
        return None
    backend = tokenizer.backend_tokenizer

    def encode(text: str) -> list[int] | None:
        if backend.truncation is not None or backend.padding is not None:
            return None
        if backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
            return None
        # encode_batch, not encode: the same ids, and it releases the GIL while it runs, so a large prompt
        # tokenized in a worker thread (the agent endpoint) does not hold up the sampling loop
        return list(backend.encode_batch([text], add_special_tokens=False)[0].ids)

    return encode
