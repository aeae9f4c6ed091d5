"""LoRA on the sharded learner (learner/lora_sharded.py): 2 `sharded_learner` ranks (FSDP2, gloo, each a fresh
`python -m benchmarks.learner_ranks` process, as tests/component/test_sharded_distributed.py runs them) train,
publish and checkpoint a LoRA run as the one-process LoRA `Learner` computed here does on the same trees, and
their DCP checkpoint resumes exactly. Two multi-process launches in all: one run of 2 steps (checkpoint after
the first, everything dumped after each), shared by the tests (`sharded`), and one resume; a one-rank LoRA
checkpoint (format 1) resumes on a `sharded_learner` of a 1-rank process group in this process."""

import json
import os
import socket
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from learner_group_fixtures import B, batches, load_tiny
from safetensors.torch import load_file

from benchmarks.learner_ranks import run_ranks, write_inputs
from configs.schema import parse_config, to_dict
from learner import lora
from learner.distributed import init_process_group
from learner.learner import Learner
from learner.sharded import sharded_learner
from storage.checkpoint import load_latest
from storage.dcp_checkpoint import adapter_tensors, full_model_tensors

pytestmark = pytest.mark.slow
RANK, ALPHA = 4, 8.0


def lora_cfg(run_dir):
    """2 mini-batches (the second trains A too: B is no longer zero) of micro-batches under a 24-token budget
    (trees split, padding passes on the rank with fewer), clipping on, adapters published to HF samplers."""
    learner = {"batch_trees": B, "minibatches": 2, "lr": 3e-4, "ranks": 2, "max_tokens_per_microbatch": 24}
    learner["lora"] = {"rank": RANK, "alpha": ALPHA}
    data = {
        "run": {"run_dir": str(run_dir), "seed": 3},
        "algo": {"method": "treeopsd", "rho": 0.4},
        "learner": learner,
        "sampler": {"backend": "hf"},
        "resources": {"learner": {"num_cpus": 1}},
    }
    return parse_config(data)


def lora_learner(model_dir, cfg):
    """The one-process LoRA learner, seeded as each rank process seeds itself before loading the model
    (benchmarks/learner_ranks.py `_learner`): the same Kaiming draw of every lora_A."""
    torch.manual_seed(cfg.run.seed)
    model, tok = load_tiny(model_dir)
    return Learner(model, cfg, tokenizer=tok)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def adapters(state):
    return {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] in ("lora_A", "lora_B")}


def rel_gap(got: dict, want: dict) -> float:
    """max|got - want| over every tensor, relative to max|want| over every tensor (the same names in both).
    Over the whole adapter, not per element or per B: after one AdamW step B is all update, lr·g/(|g| + eps)
    per element, and an element whose gradient is near eps carries that gradient's rounding (2 ranks sum in
    another order) into up to ~1e-4·lr (measured: 1.9e-8 at lr 3e-4, 3e-5 of B's largest value)."""
    assert got.keys() == want.keys()
    gap = max(float((got[k].float() - v.float()).abs().max()) for k, v in want.items())
    return gap / max(float(v.float().abs().max()) for v in want.values())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_model_dir):
    """Launch 1: 2 ranks, 2 steps, a DCP checkpoint after step 1; the one-process run of the same steps."""
    tmp = tmp_path_factory.mktemp("lora-ranks")
    cfg = lora_cfg(tmp / "run")
    plain, tok = load_tiny(tiny_model_dir)
    first, second = batches(plain, tok, 2)  # on-policy for the base: the adapted model at B = 0
    write_inputs(tmp, first + second)
    ranks = run_ranks(
        tmp, 2, to_dict(cfg), model_dir=tiny_model_dir, steps=2, save_at=(1,), dump=True, tag="first"
    )
    ref = lora_learner(tiny_model_dir, cfg)
    init = snapshot(ref.model)
    stats1 = ref.step(first)
    state1 = snapshot(ref.model)
    published1 = lora.published_weights(ref.model, cfg, ref.named_weights)
    stats2 = ref.step(second)
    return SimpleNamespace(
        tmp=tmp,
        cfg=cfg,
        model_dir=tiny_model_dir,
        ranks=ranks,
        ref=ref,
        base=snapshot(plain),
        plain=plain,
        second=second,
        stats=(stats1, stats2),
        init=init,
        state1=state1,
        state2=snapshot(ref.model),
        published1=published1,
    )


def test_two_lora_ranks_train_and_publish_the_one_rank_step(sharded):
    s, out = sharded, sharded.tmp / "first"
    for r in s.ranks:  # every rank: the same step figures as one rank (micro-batches of every rank combined)
        for got, want in zip(r["stats"], s.stats, strict=True):
            assert got["learner/loss"] == pytest.approx(want["learner/loss"], rel=1e-6, abs=1e-7)
            # the clipping norm: the adapters' gradients over both ranks' shards (the base has none)
            assert got["learner/grad_norm"] == pytest.approx(want["learner/grad_norm"], rel=1e-5)
            assert got["learner/tokens"] == want["learner/tokens"]
    assert s.ranks[0]["stats"][0]["learner/microbatches"] >= 4  # trees split into pieces under 24 tokens
    # gradients and AdamW: the adapters' shards only (fp32, each rank half of each tensor; AdamW's moments
    # and one 4-byte step count per adapter tensor)
    n_tensors, n_values = len(adapters(s.state1)), sum(v.numel() for v in adapters(s.state1).values())
    assert n_tensors == 28  # 2 layers × 7 projections × (A, B)
    for r in s.ranks:
        assert r["state_bytes"]["grads"] == 4 * n_values // 2
        assert r["state_bytes"]["optimizer"] == 2 * 4 * n_values // 2 + 4 * n_tensors

    got1 = load_file(str(out / "state1.safetensors"))  # the full state after step 1, gathered from shards
    assert got1.keys() == s.state1.keys()
    base = {k: v for k, v in got1.items() if k not in adapters(got1)}
    assert base.keys() == s.base.keys()
    assert all(torch.equal(v, s.base[k]) and torch.equal(v, s.state1[k]) for k, v in base.items())  # frozen
    for part in ("lora_A", "lora_B"):  # both moved in the step (A through the second mini-batch, B ≠ 0 there)
        assert max(float((got1[k] - v).abs().max()) for k, v in s.init.items() if k.endswith(part)) > 1e-5
    assert rel_gap(adapters(got1), adapters(s.state1)) <= 1e-6

    published = load_file(str(out / "published1.safetensors"))  # what rank 0 published after step 1
    assert published.keys() == s.published1.keys() == adapters(s.state1).keys()
    assert rel_gap(published, dict(s.published1)) <= 1e-6
    meta = json.loads((out / "published1.json").read_text())
    assert meta == s.published1.meta and meta["kind"] == "lora_adapter" and meta["scaling"] == ALPHA / RANK
    assert meta["base_fingerprint"] == lora.base_fingerprint(s.plain)  # the base's, computed unsharded
    # samplers that take no adapter: rank 0's merged weights after step 2, as one rank serves them
    served = load_file(str(out / "weights.safetensors"))
    want = {k: v.float() for k, v in lora.served_parameters(s.ref.model).items()}
    assert served.keys() == want.keys() and rel_gap(served, want) <= 1e-6


def merged(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W + (alpha/r)·B·A folded into each adapted weight of a full state dict, the adapters left out."""
    out = {k: v for k, v in state.items() if k not in adapters(state)}
    for name in {k.rsplit(".", 1)[0] for k in adapters(state)}:
        lift = state[f"{name}.lora_B"] @ state[f"{name}.lora_A"]
        out[f"{name}.weight"] = state[f"{name}.weight"] + lift * (ALPHA / RANK)
    return out


def test_lora_dcp_checkpoint_resumes_exactly_on_two_ranks_and_on_one(sharded):
    s, first = sharded, load_file(str(sharded.tmp / "first" / "state1.safetensors"))
    ckpt = load_latest(s.tmp / "run")
    assert ckpt.step == 1 and ckpt.meta["format"] == 2 and ckpt.meta["ranks"] == 2
    fingerprint = lora.base_fingerprint(s.plain)
    assert ckpt.meta["lora"] == {
        "base_fingerprint": fingerprint,
        "rank": RANK,
        "alpha": ALPHA,
        "dropout": 0.0,
        "layers": 14,
    }
    kept = full_model_tensors(ckpt)  # the checkpoint's model, what export reads: the merged weights
    want = merged(first)
    assert kept.keys() == want.keys() and rel_gap(kept, want) <= 1e-6
    kept = adapter_tensors(ckpt)  # and the adapter (export's PEFT folder), exactly as trained
    assert kept.keys() == adapters(first).keys() and all(torch.equal(v, first[k]) for k, v in kept.items())
    from launch.cmd_export import checkpoint_adapter  # export reads the sharded adapter too, not a warning

    exported = checkpoint_adapter(ckpt)
    assert exported is not None and exported[1] == ckpt.meta["lora"]
    assert all(torch.equal(v, kept[k]) for k, v in exported[0].items()) and exported[0].keys() == kept.keys()

    # launch 2: 2 ranks resume the step-1 checkpoint and train step 2 as the uninterrupted 2-rank run did
    again = run_ranks(
        s.tmp, 2, to_dict(s.cfg), model_dir=s.model_dir, restore=True, first_batch=1, dump=True, tag="second"
    )
    assert [r["restored_step"] for r in again] == [1, 1]
    assert again[0]["stats"][0]["learner/loss"] == s.ranks[0]["stats"][1]["learner/loss"]
    uninterrupted = load_file(str(s.tmp / "first" / "state2.safetensors"))
    resumed = load_file(str(s.tmp / "second" / "state1.safetensors"))
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], v) for k, v in uninterrupted.items())  # bit for bit, AdamW included
    assert rel_gap(adapters(resumed), adapters(s.state2)) <= 1e-6  # and the one-process run's step 2

    one = lora_learner(s.model_dir, s.cfg)  # 2 ranks → 1: the plain LoRA learner reads the DCP shards
    assert one.restore(s.tmp / "run").step == 1 and one.version == 1
    restored = snapshot(one.model)
    assert all(torch.equal(restored[k], v) for k, v in first.items())  # the adapter exactly, the base as is
    one.step(s.second)
    assert rel_gap(adapters(snapshot(one.model)), adapters(uninterrupted)) <= 1e-6

    foreign = Learner(scaled_base(s.model_dir), s.cfg)
    with pytest.raises(lora.LoraError) as info:
        foreign.restore(s.tmp / "run")
    live = lora.base_fingerprint(foreign.model)
    assert live != fingerprint and str(info.value) == (
        f"{ckpt.path}: the LoRA adapter was trained on another base model (fingerprint {fingerprint}, this "
        f"model's is {live}); use the base it was trained on (the run's model.path)"
    )


def scaled_base(model_dir):
    """Another base: the tiny model with every weight scaled (another fingerprint)."""
    model, _ = load_tiny(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    return model


def test_one_rank_lora_checkpoint_resumes_on_a_sharded_learner(tmp_path, tiny_model_dir):
    """Format 1 (a one-process LoRA run's: merged model.safetensors, the adapter in lora.safetensors) into a
    `sharded_learner` (FSDP2 DTensors over a 1-rank gloo group in this process): the adapter and AdamW's
    moments alone, exactly, and the next step as one process's; another base refused in one line."""
    cfg = lora_cfg(tmp_path / "run")
    plain, tok = load_tiny(tiny_model_dir)
    first, second = batches(plain, tok, 2)
    one = lora_learner(tiny_model_dir, cfg)
    one.step(first)
    one.save(tmp_path / "run")
    saved = snapshot(one.model)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with mock.patch.dict(os.environ):  # init_process_group sets MASTER_ADDR, RANK, ...: put back after
        init_process_group(0, 1, "127.0.0.1", port, 60.0, torch.device("cpu"))
        try:
            sharded = sharded_learner(load_tiny(tiny_model_dir)[0], cfg)
            assert sharded.restore(tmp_path / "run").step == 1 and sharded.version == 1
            restored = sharded.model.state_dict()
            assert restored.keys() == saved.keys()
            assert all(torch.equal(restored[k].full_tensor(), v) for k, v in saved.items())
            sharded.step(second)
            one.step(second)
            got = {k: v.full_tensor() for k, v in adapters(sharded.model.state_dict()).items()}
            assert rel_gap(got, adapters(snapshot(one.model))) <= 1e-6

            foreign = sharded_learner(scaled_base(tiny_model_dir), cfg)
            with pytest.raises(lora.LoraError) as info:
                foreign.restore(tmp_path / "run")
            kept, live = lora.base_fingerprint(plain), lora.base_fingerprint(foreign.model)
            assert kept != live and str(info.value) == (
                f"{load_latest(tmp_path / 'run').path}: the LoRA adapter was trained on another base model "
                f"(fingerprint {kept}, this model's is {live}); use the base it was trained on (the run's "
                "model.path)"
            )
        finally:
            torch.distributed.destroy_process_group()
