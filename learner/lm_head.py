"""The LM head over the loss tokens, chunked: log π(y | h) without ever holding [n tokens × vocab] logits.

    lp = sampled_token_logprobs(h, model.get_output_embeddings(), labels, sampling, chunk_tokens=2048)

`learner/forward.py` scores n loss tokens; the plain way builds the [n, V] fp32 logits, the sampling
log-probs over them and their backward: at 16k tokens and Qwen3's V = 151,936 that is ~10 GB of logits and
several times that through softmax, top-p and autograd. Only the label's log-prob is needed, so this module
runs the head `chunk_tokens` rows at a time and keeps nothing of size V between chunks.

The math, for one row with hidden state h, head weight W [V, H] (bias b), label y and the sampling
distribution of system/sampling.py (temperature T; T = 1 and no cut for T ≤ 0 or no sampling spec):

    z = W h + b                     (fp32 logits, [V])
    s = z / T
    K = kept set: top-k / top-p of s (`system.sampling._dropped`), with y always in K
    log π(y) = s_y − log Σ_{j∈K} exp(s_j)

K is a selection, not a function the gradient flows through (as in `sampling_logprobs`), so with
p_j = softmax over K of s (p_j = 0 off K), and g the upstream gradient of log π(y):

    ∂ log π(y) / ∂ z_j = g · (1[j = y] − p_j) / T          (0 off K, since y ∈ K and p_j = 0 there)
    ∂/∂h = Σ_j G_j W_j,    ∂/∂W_j = G_j h,    ∂/∂b_j = G_j    with G_j = ∂ log π(y) / ∂ z_j

The autograd.Function saves only h, W, b and the labels; backward recomputes each chunk's logits and K
(deterministic, so the same set) and accumulates the gradients in fp32. Peak extra memory is one chunk's
[c, V] fp32 logits (updated in place) plus `_dropped`'s temporaries when top-k/top-p is on, instead of
several [n, V] tensors. log π(y) is finite whenever the logits are: y ∈ K, so the sum includes exp(s_y).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from system.policy import SamplingConfig
from system.sampling import _dropped


def sampled_token_logprobs(
    hidden: Tensor,
    head: nn.Module | Tensor,
    labels: Tensor,
    sampling: SamplingConfig | None,
    chunk_tokens: int,
    tf32: bool = False,
) -> Tensor:
    """[n, H] hidden states, [n] long labels -> [n] float32 log π(label | h) under the sampling
    distribution (system/sampling.py semantics, exactly: temperature, top-k, top-p, the label kept;
    temperature <= 0 or sampling None: plain log_softmax of the raw logits), computed chunk_tokens rows at
    a time (<= 0: one chunk). Differentiable w.r.t. hidden and the head's weight (and bias if any).

    `head` is the model's output-embedding module (its weight [V, H] and bias, maybe None, are used, so a
    weight tied to the input embeddings gets its gradient through the one Parameter) or a bare weight
    tensor (e.g. a parameter the caller took from an FSDP2 module)."""
    weight, bias = (head, None) if isinstance(head, Tensor) else (head.weight, getattr(head, "bias", None))
    if not isinstance(weight, Tensor):
        raise TypeError(f"the head's weight must be a tensor, got {type(weight).__name__}")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.shape[1:] != hidden.shape[1:]:
        raise ValueError(
            f"expected hidden [n, H], labels [n], weight [V, H]; got {tuple(hidden.shape)}, "
            f"{tuple(labels.shape)}, {tuple(weight.shape)}"
        )
    spec = sampling if sampling is not None and sampling.temperature > 0 else None
    out: Tensor = _ChunkedHead.apply(  # type: ignore[no-untyped-call]
        hidden, weight, bias, labels.long(), spec, int(chunk_tokens), tf32
    )
    return out


@contextmanager
def fp32_matmuls(tf32: bool) -> Iterator[None]:
    """The head's fp32 matmuls on TensorFloat-32 tensor cores (10-bit mantissa inputs, fp32 accumulation)
    while `tf32`: what the bf16 learner asks for, as its decoder already multiplies in bf16 (7 bits). In
    strict fp32 the head was about a fifth of a Qwen3 step on an H200 (docs/design.md §11); TF32 moves a
    logit by ~|z|·2⁻¹¹, far below the bf16 decoder's own rounding. Not thread-safe (a process-wide flag):
    one forward or backward at a time, as the learner runs."""
    if not tf32 or not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _spans(n: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Row ranges [i, j) of the chunks (chunk_tokens <= 0: one chunk of all n rows)."""
    step = max(chunk_tokens if chunk_tokens > 0 else n, 1)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _kept_scaled(h: Tensor, w: Tensor, b: Tensor | None, y: Tensor, spec: SamplingConfig | None) -> Tensor:
    """[c, V] fp32 s = (h Wᵀ + b) / T with −inf off the kept set, built in one buffer (in place), so a chunk
    costs one [c, V] fp32 tensor. Same operations, in the same order, as `sampling_logprobs`, so the kept
    set and the values are the unchunked path's."""
    s = torch.nn.functional.linear(h.float(), w, b)
    if spec is None:
        return s
    s.div_(spec.temperature)
    drop = _dropped(s, spec)
    if drop is not None:
        s.masked_fill_(drop.scatter_(-1, y.unsqueeze(-1), False), -math.inf)
    return s


def _exp_shifted(s: Tensor) -> tuple[Tensor, Tensor]:
    """In place: s ← exp(s − max_row s) (0 off the kept set); returns (s, max_row). The row max is a kept
    finite logit whenever the logits are finite, so the row sum is ≥ 1 and its log is finite."""
    top = s.amax(dim=-1, keepdim=True)
    return s.sub_(top).exp_(), top


class _ChunkedHead(torch.autograd.Function):
    """log π(label | h) through the LM head, chunk by chunk; backward recomputes the chunks."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        spec: SamplingConfig | None,
        chunk_tokens: int,
        tf32: bool,
    ) -> Tensor:
        """Each chunk: logits, kept set, the label's log-prob; the chunk is dropped before the next, and only
        the inputs are saved (backward recomputes, trading one extra head matmul for O(n·V) memory)."""
        ctx.save_for_backward(hidden, weight, bias, labels)  # type: ignore[arg-type]  # None bias is allowed
        ctx.spec, ctx.chunk_tokens, ctx.tf32 = spec, chunk_tokens, tf32  # type: ignore[attr-defined]
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False), fp32_matmuls(tf32):  # fp32 under bf16 too
            w, b = weight.float(), None if bias is None else bias.float()
            for i, j in _spans(hidden.shape[0], chunk_tokens):
                y = labels[i:j]
                s = _kept_scaled(hidden[i:j], w, b, y, spec)
                label_s = s.gather(1, y.unsqueeze(1)).squeeze(1)
                e, top = _exp_shifted(s)
                out[i:j] = label_s - top.squeeze(1) - e.sum(dim=-1).log()
                del s, e  # one chunk's [c, V] at a time
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        """Recompute each chunk's kept-set logits, turn them into G = ∂ log π(y)/∂z in place, and accumulate
        G·W, Gᵀ·h and ΣG in fp32 (the bf16 learner's head gradient is summed over all chunks in fp32, then
        cast once). Only the gradients autograd asks for are formed (a frozen head costs no [V, H])."""
        hidden, weight, bias, labels = ctx.saved_tensors
        spec: SamplingConfig | None = ctx.spec
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        inv_t = 1.0 if spec is None else 1.0 / spec.temperature
        with torch.autocast(hidden.device.type, enabled=False), fp32_matmuls(ctx.tf32):
            w, b = weight.float(), None if bias is None else bias.float()
            gh = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            gb = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if need_b else None
            g = grad_out.float() * inv_t
            for i, j in _spans(hidden.shape[0], ctx.chunk_tokens):
                h, y = hidden[i:j].float(), labels[i:j]
                grad_z = _grad_logits(_kept_scaled(h, w, b, y, spec), y, g[i:j])
                if gh is not None:
                    torch.mm(grad_z, w, out=gh[i:j])
                if gw is not None:
                    gw.addmm_(grad_z.T, h)
                if gb is not None:
                    gb.add_(grad_z.sum(dim=0))
                del grad_z
        return (
            None if gh is None else gh.to(hidden.dtype),
            None if gw is None else gw.to(weight.dtype),
            None if gb is None else gb.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def _grad_logits(s: Tensor, y: Tensor, g: Tensor) -> Tensor:
    """In place on the kept-set logits s [c, V]: G = g · (onehot(y) − softmax_K(s)) (g already carries 1/T);
    0 off the kept set, where softmax_K is 0 and y never is."""
    p, _ = _exp_shifted(s)
    p.div_(p.sum(dim=-1, keepdim=True)).neg_()
    p.scatter_add_(1, y.unsqueeze(1), torch.ones_like(p[:, :1]))
    return p.mul_(g.unsqueeze(1))
