"""The chunked LM head (learner/lm_head.py) against the unchunked path that learner/forward.py runs
(`sampling_logprobs(head(h).float(), spec, keep=labels)` or a plain log-softmax, then the label's column):
the same values and gradients for every chunk size and sampling setting, one gradient for tied weights,
and a peak memory of one chunk's logits instead of all of them."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from learner.lm_head import sampled_token_logprobs
from system.policy import SamplingConfig
from system.sampling import sampling_logprobs

N, H, V = 300, 32, 500
SPECS = {
    "none": None,
    "t1": SamplingConfig(temperature=1.0),
    "t0.7_p0.9": SamplingConfig(temperature=0.7, top_p=0.9),
    "t1.3_k20": SamplingConfig(temperature=1.3, top_k=20),
    "t0.8_k50_p0.8": SamplingConfig(temperature=0.8, top_p=0.8, top_k=50),
    "greedy": SamplingConfig(temperature=0.0, top_p=0.5, top_k=5),  # T ≤ 0: the raw log-softmax, no cut
}
CHUNKS = [1, 7, 64, N, 0]


def reference(h: Tensor, head: nn.Module, labels: Tensor, spec: SamplingConfig | None) -> Tensor:
    """The unchunked path, as learner/forward.py::token_logprobs computes it."""
    logits = head(h.float()).float()
    dist = sampling_logprobs(logits, spec, keep=labels) if spec else torch.log_softmax(logits, -1)
    return dist.gather(1, labels[:, None])[:, 0]


def case(bias: bool, seed: int = 0) -> tuple[Tensor, nn.Linear, Tensor, Tensor]:
    """Hidden states, a head with logits of std ~3 (so top-p cuts), labels (half the argmax, half uniform:
    most of those lie outside the kept set and must be kept) and a random upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen) * 0.5)
        if bias:
            head.bias.copy_(torch.randn(V, generator=gen))
    h = torch.randn(N, H, generator=gen)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::2] = head(h).argmax(-1)[::2]
    return h, head, labels, torch.randn(N, generator=gen)


def grads(fn: Any, h: Tensor, head: nn.Linear, gout: Tensor) -> tuple[Tensor, list[Tensor]]:
    """fn's value and its gradients w.r.t. (hidden, weight[, bias]) under the upstream gradient gout."""
    h = h.detach().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    out = fn(h)
    out.backward(gout)
    return out.detach(), [h.grad, *(p.grad for p in head.parameters())]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", list(SPECS))
def test_values_match_the_unchunked_path(name: str, chunk: int, bias: bool) -> None:
    h, head, labels, _ = case(bias)
    spec = SPECS[name]
    with torch.no_grad():
        ref = reference(h, head, labels, spec)
        got = sampled_token_logprobs(h, head, labels, spec, chunk)
    assert got.dtype == torch.float32 and got.shape == (N,)
    assert torch.isfinite(got).all()  # the label is always in the support
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()
    if name in ("t0.7_p0.9", "t1.3_k20"):  # the cut is really on: the labels outside it are kept
        dropped = torch.isinf(sampling_logprobs(head(h).float(), spec)).sum(-1)
        assert (
            dropped.min() > 0
            and torch.isinf(sampling_logprobs(head(h), spec).gather(1, labels[:, None])).any()
        )


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", list(SPECS))
def test_gradients_match_the_unchunked_autograd(name: str, chunk: int, bias: bool) -> None:
    h, head, labels, gout = case(bias, seed=1)
    spec = SPECS[name]
    _, ref_grads = grads(lambda x: reference(x, head, labels, spec), h, head, gout)
    _, got_grads = grads(lambda x: sampled_token_logprobs(x, head, labels, spec, chunk), h, head, gout)
    assert len(got_grads) == (3 if bias else 2)
    for g, r in zip(got_grads, ref_grads, strict=True):
        assert g is not None and g.dtype == torch.float32
        assert (g - r).norm() <= 1e-6 * r.norm(), (g - r).norm() / r.norm()


@pytest.mark.parametrize("as_tensor", [False, True])
def test_tied_weights_get_one_gradient(as_tensor: bool) -> None:
    """An input embedding used as the LM head (tied, the same Parameter): its one .grad holds both uses,
    whether the head is passed as a module or as the bare weight."""
    gen = torch.Generator().manual_seed(2)
    emb = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    head.weight = emb.weight
    ids, labels = torch.randint(0, V, (N,), generator=gen), torch.randint(0, V, (N,), generator=gen)
    gout, spec = torch.randn(N, generator=gen), SamplingConfig(temperature=0.9, top_p=0.95)

    def tied_grad(fn: Any) -> Tensor:
        emb.zero_grad(set_to_none=True)
        fn(torch.tanh(emb(ids) * 2.0)).backward(gout)
        assert emb.weight.grad is not None
        return emb.weight.grad.clone()

    ref = tied_grad(lambda h: reference(h, head, labels, spec))
    got = tied_grad(lambda h: sampled_token_logprobs(h, emb.weight if as_tensor else head, labels, spec, 37))
    assert list(head.parameters()) == [emb.weight]
    assert (got - ref).norm() <= 1e-6 * ref.norm()


def test_frozen_head_and_bf16_inputs() -> None:
    """A head that needs no gradient gets none; bf16 hidden/weight (the autocast learner) are scored in
    fp32 and get their gradients back in their own dtype."""
    h, head, labels, gout = case(bias=True, seed=3)
    head.requires_grad_(False)
    x = h.clone().requires_grad_(True)
    sampled_token_logprobs(x, head, labels, SPECS["t1.3_k20"], 64).backward(gout)
    assert x.grad is not None and head.weight.grad is None and head.bias.grad is None
    hb = h.bfloat16().requires_grad_(True)
    wb = head.weight.detach().bfloat16().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sampled_token_logprobs(hb, wb, labels, None, 64)
    out.backward(gout)
    assert out.dtype == torch.float32 and hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    ref = torch.log_softmax(hb.float() @ wb.float().T, -1).gather(1, labels[:, None])[:, 0]
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created while active: each new output storage (not a view of an
    input's, nor an in-place result) adds its size and subtracts it when it is freed (weakref.finalize on
    the storage), tracking the max."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen = {
            a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)
        }
        seen.update(self.live)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in seen and st.nbytes() > 0:
                    self.live[st.data_ptr()] = st.nbytes()
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._free, st.data_ptr())
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)


def peak_bytes(fn: Any, h: Tensor, w: Tensor, gout: Tensor) -> int:
    """Peak live bytes of fn's forward + backward (inputs made outside, so not counted)."""
    x, weight = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with PeakBytes() as mem:
        fn(x, weight).backward(gout)
    assert x.grad is not None and weight.grad is not None
    return mem.peak


# Buffers of [chunk, V] fp32 allowed at once: 2 without a top-p cut (the chunk's logits, updated in place,
# plus top-k's boolean masks); top-p's `system.sampling._dropped` holds ~7 more (masked logits, softmax,
# sorted probs, their int64 order = 2, cumsum, mass-before, masks): allowed 9.
@pytest.mark.parametrize(("name", "buffers"), [("none", 2), ("t1.3_k20", 2), ("t0.7_p0.9", 9)])
def test_peak_memory_is_one_chunk_of_logits(name: str, buffers: int) -> None:
    n, hid, vocab, chunk = 2048, 64, 4096, 128
    gen = torch.Generator().manual_seed(4)
    h, w = torch.randn(n, hid, generator=gen), torch.randn(vocab, hid, generator=gen) * 0.3
    labels, gout = torch.randint(0, vocab, (n,), generator=gen), torch.randn(n, generator=gen)
    spec = SPECS[name]
    chunked = peak_bytes(lambda x, wt: sampled_token_logprobs(x, wt, labels, spec, chunk), h, w, gout)
    full = peak_bytes(lambda x, wt: reference(x, lambda y: y @ wt.T, labels, spec), h, w, gout)
    # Allowed: `buffers` · chunk·V·4 (2 · 128·4096·4 = 4 MiB) plus what the call itself makes: grad_h
    # (n·H·4 = 512 KiB), grad_W (V·H·4 = 1 MiB), the output and upstream gradient (n·4 = 8 KiB each) and
    # the labels (n·8 = 16 KiB): ≈ 5.6 MiB (top-p: ≈ 20 MiB), against n·V·4 = 32 MiB for the unchunked
    # path's logits alone (its measured peak is a few times that).
    own = 4 * (2 * n * hid + vocab * hid) + 8 * n + 8 * n
    assert chunked < buffers * chunk * vocab * 4 + own, (chunked, full)
    assert full > n * vocab * 4


def test_empty_and_shape_checks() -> None:
    h, head, labels, _ = case(bias=False)
    assert sampled_token_logprobs(h[:0], head, labels[:0], None, 0).shape == (0,)
    with pytest.raises(ValueError, match="expected hidden"):
        sampled_token_logprobs(h, head, labels[:-1], None, 8)
