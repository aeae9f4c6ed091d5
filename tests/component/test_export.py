"""`treeopsd export` and the DCP checkpoint in one process: a learner checkpoint of either format (format 1:
one rank's safetensors; format 2: the sharded learner's DCP shards, here written without a process group)
becomes an HF folder that `AutoModelForCausalLM.from_pretrained` loads and that scores the stored tokens as
the learner's own weights do; a format-2 checkpoint restores model, AdamW state and RNG exactly."""

import pytest
import torch
from learner_group_fixtures import batches, group_cfg, load_tiny, reference

from launch.cli import main
from learner.forward import token_logprobs
from learner.packing import pack_trees
from storage.checkpoint import load_latest
from storage.dcp_checkpoint import save_dcp_checkpoint


@pytest.fixture
def trained(tmp_path, tiny_model_dir):
    """A Learner after one step on the tiny model, and the batch it trained."""
    learner = reference(tiny_model_dir, group_cfg(tmp_path / "run", ranks=1))
    (trees,) = batches(learner.model, learner.tokenizer, 1)
    learner.step(trees)
    return learner, trees


def save(learner, run_dir, fmt: int):
    if fmt == 1:
        return learner.save(run_dir)
    return save_dcp_checkpoint(
        run_dir,
        learner.version,
        learner.model,
        learner.optimizer,
        version=learner.version,
        extra={"watermark": 1},
        tokenizer=learner.tokenizer,
    )


@pytest.mark.parametrize("fmt", [1, 2])
def test_export_writes_a_folder_that_from_pretrained_loads_and_scores_alike(trained, tmp_path, fmt, capsys):
    learner, trees = trained
    save(learner, tmp_path / "run", fmt)
    assert load_latest(tmp_path / "run").meta["format"] == fmt
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert f"format {fmt}" in capsys.readouterr().out
    exported, tok = load_tiny(tmp_path / "hf")  # AutoModelForCausalLM / AutoTokenizer.from_pretrained
    assert tok.get_vocab() == learner.tokenizer.get_vocab()
    live = learner.model.state_dict()
    assert all(torch.equal(live[k], v) for k, v in exported.state_dict().items())  # fp32, bit for bit
    packed = pack_trees(trees, concat=True)
    with torch.no_grad():
        a, b = token_logprobs(exported, packed), token_logprobs(learner.model.eval(), packed)
    assert float((a - b).abs().max()) <= 1e-5


def test_export_picks_the_step_casts_and_refuses_what_it_cannot_write(trained, tmp_path, capsys):
    learner, trees = trained
    save(learner, tmp_path / "run", 2)  # step 1
    step1 = {k: v.clone() for k, v in learner.model.state_dict().items()}
    learner.step(trees)
    save(learner, tmp_path / "run", 2)  # step 2, the newest
    out = tmp_path / "hf1"
    assert main(["export", str(tmp_path / "run"), "--step", "1", "--dtype", "bfloat16", str(out)]) == 0
    assert "step 1" in capsys.readouterr().out
    model, _ = load_tiny(out)  # read back as fp32: the step-1 weights rounded to bf16
    assert all(torch.equal(v, step1[k].bfloat16().float()) for k, v in model.state_dict().items())
    assert main(["export", str(tmp_path / "run"), str(out)]) == 2  # OUT exists
    assert "exists" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "hf2")]) == 2
    assert f"run directory {tmp_path / 'nothing'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()  # a folder, but no run in it
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "hf2")]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "hf2").exists()


def test_dcp_checkpoint_restores_model_optimizer_and_rng_in_one_process(trained, tmp_path, tiny_model_dir):
    learner, trees = trained
    save(learner, tmp_path / "run", 2)
    want_rng = torch.get_rng_state()
    want = learner.step(trees)
    torch.manual_seed(123)  # scrambled: the restore must bring the checkpoint's RNG state back
    other = reference(tiny_model_dir, group_cfg(tmp_path / "run", ranks=1))
    assert other.restore(tmp_path / "run").step == 1 and other.version == 1
    assert torch.equal(torch.get_rng_state(), want_rng)
    got = other.step(trees)  # the same AdamW moments: the same second step
    assert got["learner/loss"] == pytest.approx(want["learner/loss"], abs=1e-6)
    live, mine = learner.model.state_dict(), other.model.state_dict()
    assert max(float((live[k] - mine[k]).abs().max()) for k in live) <= 1e-6
