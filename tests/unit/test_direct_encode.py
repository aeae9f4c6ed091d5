"""`direct_encoder` (actors/protocols/direct_encode.py): the Rust tokenizer's encode gives the ids that
`tokenizer.encode(text, add_special_tokens=False)` gives, and steps aside whenever it could not."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_fixtures import ADDED, TEXTS, qwen3_tokenizer

from actors.protocols.direct_encode import direct_encoder

TOKENIZER = qwen3_tokenizer()
PIECES = [
    *ADDED,
    "<|im_start|>",
    "<|im_end|>",
    "user\n",
    "tool",
    " Paris",
    "Tavo Mirel",
    "\n\n",
    "  ",
    "é",
    "🙂",
]


def wrapper_ids(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES + TEXTS[:4]) | st.text(max_size=12), max_size=10))
def test_direct_ids_equal_the_wrappers_on_any_text(parts: list[str]) -> None:
    text = "".join(parts)
    encode = direct_encoder(TOKENIZER)
    assert encode is not None  # a TokenizersBackend that does not override encoding: the direct path is taken
    assert encode(text) == wrapper_ids(text)


def test_special_tokens_are_single_ids_as_in_the_wrapper() -> None:
    encode = direct_encoder(TOKENIZER)
    assert encode is not None
    text = "<|im_end|>\n<|im_start|>user\n<tool_response>\nParis\n</tool_response><|im_end|>"
    ids = encode(text)
    assert ids == wrapper_ids(text)
    im_end = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
    assert ids[0] == im_end and ids[-1] == im_end and ids.count(im_end) == 2


def test_steps_aside_when_the_backend_is_not_as_the_wrapper_leaves_it() -> None:
    """Truncation or padding left on the backend, or `split_special_tokens` changed: None (the caller then
    uses the wrapper, which resets the backend for its own call)."""
    tok = qwen3_tokenizer()
    encode = direct_encoder(tok)
    assert encode is not None
    text = TEXTS[1]
    full = list(tok.encode(text, add_special_tokens=False))
    assert len(full) > 3
    tok.backend_tokenizer.enable_truncation(max_length=3)
    assert encode(text) is None
    assert list(tok.encode(text, add_special_tokens=False)) == full  # the wrapper switched truncation off
    assert encode(text) == full
    tok.backend_tokenizer.enable_padding(length=len(full) + 5)
    assert encode(text) is None
    tok.backend_tokenizer.no_padding()
    tok.split_special_tokens = True
    assert encode("<|im_end|>") is None
    assert len(tok.encode("<|im_end|>", add_special_tokens=False)) > 1  # the wrapper splits it now


def test_no_direct_path_for_a_tokenizer_with_its_own_encoding() -> None:
    tok = qwen3_tokenizer()

    class Custom(type(tok)):  # type: ignore[misc]
        def _encode_plus(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super()._encode_plus(*args, **kwargs)

    tok.__class__ = Custom
    assert direct_encoder(tok) is None
    assert direct_encoder(object()) is None
