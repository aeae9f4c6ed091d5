"""The sampling distribution, one definition for both sides (docs/algorithm.md §11): the HF backend samples
from it and stores its log-probs, vLLM computes the same (`logprobs_mode="processed_logprobs"`), and the
learner scores stored tokens under it, so μ and π_θ describe the same distribution at every temperature,
top-p and top-k.

    logp = sampling_logprobs(logits, SamplingConfig(temperature=0.7, top_p=0.9))       # [..., V]
    logp = sampling_logprobs(logits, spec, keep=labels)    # the learner: each row's sampled token kept

The transform (vLLM's and Hugging Face's convention): logits / T; top-k keeps the k largest (ties at the
k-th value kept); top-p keeps the smallest set of most likely tokens whose mass reaches p (a token is dropped
when the mass strictly before it, in descending order, is already ≥ p; the first token always stays); the
rest is renormalized by a log-softmax over what is kept. The kept set is a selection, not a function the
gradient flows through: `drop` is computed without grad, and the log-softmax over the kept logits is what is
differentiated. With `keep`, each row's own token is never dropped: at the weights that sampled it the token
is inside the kept set anyway (the sampler drew it from there), and after an update it keeps a finite
log-prob instead of −inf. Temperature ≤ 0 is greedy decoding: the model's own log-probs (T = 1, no cut).
"""

from __future__ import annotations

import math

import torch

from system.policy import SamplingConfig


def sampling_logprobs(
    logits: torch.Tensor, spec: SamplingConfig, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """[..., V] logits → [..., V] float32 log-probs of the sampling distribution (−inf outside its support).
    `keep`: [...] long token ids that stay in the support of their row."""
    logits = logits.float()
    if spec.temperature <= 0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / spec.temperature
    drop = _dropped(scaled.detach(), spec)
    if drop is None:
        return torch.log_softmax(scaled, dim=-1)
    if keep is not None:
        drop = drop.scatter(-1, keep.unsqueeze(-1).long(), False)
    return torch.log_softmax(scaled.masked_fill(drop, -math.inf), dim=-1)


def _dropped(scaled: torch.Tensor, spec: SamplingConfig) -> torch.Tensor | None:
    """Boolean [..., V]: the tokens top-k and top-p cut (None when neither is on)."""
    vocab = scaled.shape[-1]
    top_k = 0 < spec.top_k < vocab
    if not top_k and spec.top_p >= 1.0:
        return None
    drop = torch.zeros_like(scaled, dtype=torch.bool)
    if top_k:
        kth = torch.topk(scaled, spec.top_k, dim=-1).values[..., -1:]
        drop = scaled < kth
    if spec.top_p < 1.0:
        masked = scaled.masked_fill(drop, -math.inf)
        probs, order = torch.sort(torch.softmax(masked, dim=-1), dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token, most likely first
        cut = before >= spec.top_p
        cut[..., 0] = False  # the most likely token always stays
        drop = drop | torch.zeros_like(cut).scatter(-1, order, cut)
    return drop
