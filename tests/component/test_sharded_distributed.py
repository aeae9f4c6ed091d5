"""The sharded learner in plain processes (no Ray): 2 `sharded_learner` ranks (FSDP2, gloo on the CPU, each a
fresh `python -m benchmarks.learner_ranks` process) train the same step as the one-process `Learner` computed
here on the same trees; their DCP checkpoint resumes with 1 rank (in this process) and with 2, and exports
to an HF folder that scores the trees as the reference does. tests/ray/test_learner_group.py runs the same
through Ray actors."""

import pytest
import torch
from learner_group_fixtures import batches, group_cfg, load_tiny, max_diff, reference
from safetensors.torch import load_file

from benchmarks.learner_ranks import run_ranks, write_inputs
from configs.schema import to_dict
from storage.checkpoint import load_latest

pytestmark = pytest.mark.slow
# fp32 sums in another order on 2 ranks (~1e-7 relative); AdamW at lr 3e-4 keeps the weight differences
# far below this (the first Adam step moves every weight by ≈ lr, whatever the gradient's rounding)
TOL = 1e-5


def weights_diff(folder, model) -> float:
    """Largest |difference| of rank 0's published weights (tied once) against `model`'s parameters."""
    got = load_file(str(folder / "weights.safetensors"))
    want = dict(model.named_parameters())
    assert set(got) == set(want)
    return max(float((got[n] - p.detach()).abs().max()) for n, p in want.items())


@pytest.mark.parametrize(
    ("method", "learner"),
    [("grpo", {"max_tokens_per_microbatch": 24}), ("treeopsd", {})],  # grpo: split trees + padding passes
)
def test_two_processes_train_the_one_rank_step(tmp_path, tiny_model_dir, method, learner):
    cfg = group_cfg(tmp_path / "run", method, **learner)
    ref = reference(tiny_model_dir, cfg)
    (trees,) = batches(ref.model, ref.tokenizer, 1)
    write_inputs(tmp_path, trees)
    ranks = run_ranks(tmp_path, 2, to_dict(cfg), model_dir=tiny_model_dir, save=True, tag="ranks")
    want = ref.step(trees)
    for r in ranks:  # every rank combines every rank's micro-batch stats: the same figures everywhere
        got = r["stats"][0]
        assert got["learner/loss"] == pytest.approx(want["learner/loss"], abs=TOL)
        assert got["learner/grad_norm"] == pytest.approx(want["learner/grad_norm"], rel=1e-5)
        assert got["learner/tokens"] == want["learner/tokens"]
    if learner:  # 24-token budget: trees split into pieces, and each rank trains only its share
        assert ranks[0]["stats"][0]["learner/microbatches"] >= 4
    assert weights_diff(tmp_path / "ranks", ref.model) <= TOL
    ckpt = load_latest(tmp_path / "run")
    assert ckpt.meta["format"] == 2 and ckpt.meta["ranks"] == 2 and ckpt.step == 1


def test_two_processes_train_in_bf16_with_checkpointing(tmp_path, tiny_model_dir):
    """bf16 FSDP2 (`MixedPrecisionPolicy`: bf16 layers over fp32 master shards, fp32 reductions) with
    gradient checkpointing against the one-process bf16 autocast step: the same loss and gradient norm up
    to bf16 rounding (8 mantissa bits: ~4e-3 relative per product, averaged over the batch's tokens)."""
    keys = {"precision": "bfloat16", "grad_checkpointing": True, "max_tokens_per_microbatch": 24}
    cfg = group_cfg(tmp_path / "run", "treeopsd", **keys)
    ref = reference(tiny_model_dir, cfg)
    (trees,) = batches(ref.model, ref.tokenizer, 1)
    write_inputs(tmp_path, trees)
    got = run_ranks(tmp_path, 2, to_dict(cfg), model_dir=tiny_model_dir, tag="ranks")[0]["stats"][0]
    want = ref.step(trees)
    assert got["learner/loss"] == pytest.approx(want["learner/loss"], rel=2e-2, abs=1e-4)
    assert got["learner/grad_norm"] == pytest.approx(want["learner/grad_norm"], rel=5e-2)
    w = load_file(str(tmp_path / "ranks" / "weights.safetensors"))
    assert all(torch.isfinite(t).all() for t in w.values())


def test_dcp_checkpoint_of_two_ranks_resumes_with_one_and_two_and_exports(tmp_path, tiny_model_dir):
    from launch.cmd_export import export_checkpoint, find_checkpoint
    from learner.forward import token_logprobs
    from learner.packing import pack_trees

    cfg = group_cfg(tmp_path / "run")
    ref = reference(tiny_model_dir, cfg)
    first, second = batches(ref.model, ref.tokenizer, 2)
    write_inputs(tmp_path, first + second)
    run_ranks(tmp_path, 2, to_dict(cfg), model_dir=tiny_model_dir, save=True, tag="first")
    ref.step(first)
    want = ref.step(second)

    one = reference(tiny_model_dir, cfg)  # 2 ranks → 1: the plain Learner reads the DCP shards
    assert one.restore(tmp_path / "run").step == 1 and one.version == 1
    got = one.step(second)
    assert got["learner/loss"] == pytest.approx(want["learner/loss"], abs=TOL)
    assert max_diff(dict(one.model.state_dict()), ref.model) <= TOL

    two = run_ranks(
        tmp_path,
        2,
        to_dict(cfg),
        model_dir=tiny_model_dir,
        restore=True,
        save=True,
        first_batch=1,
        tag="second",
    )
    assert [r["restored_step"] for r in two] == [1, 1]  # 2 ranks → 2
    assert two[0]["stats"][0]["learner/loss"] == pytest.approx(want["learner/loss"], abs=TOL)
    assert weights_diff(tmp_path / "second", ref.model) <= TOL

    folder = export_checkpoint(find_checkpoint(tmp_path / "run", 2), tmp_path / "hf")
    exported, _ = load_tiny(folder)  # AutoModelForCausalLM.from_pretrained
    assert max_diff(dict(exported.state_dict()), ref.model) <= TOL
    packed = pack_trees(second, concat=True)
    with torch.no_grad():
        a, b = token_logprobs(exported, packed), token_logprobs(ref.model, packed)
    assert float((a - b).abs().max()) <= TOL

    one.save(tmp_path / "run1")  # 1 rank → 2: format 1 (one process's safetensors) cut into shards
    cfg1 = to_dict(group_cfg(tmp_path / "run1"))
    from_one = run_ranks(tmp_path, 2, cfg1, model_dir=tiny_model_dir, restore=True, tag="third")
    again = one.step(first)  # the same next step: the AdamW moments came along too
    assert [r["restored_step"] for r in from_one] == [2, 2]
    assert from_one[0]["stats"][0]["learner/loss"] == pytest.approx(again["learner/loss"], abs=TOL)
    assert weights_diff(tmp_path / "third", one.model) <= TOL
