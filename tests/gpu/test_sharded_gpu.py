"""The sharded learner on CUDA (`make gpu-check`; skipped without a GPU): a 1-rank FSDP2 process group on
NCCL in this process — an fp32 step equal to the plain Learner's, a bf16 `MixedPrecisionPolicy` step with
gradient checkpointing and micro-batches, and its DCP checkpoint exported to an HF folder that
`from_pretrained` loads and that scores the trees as the learner's weights do."""

import copy
import socket

import pytest
import torch
from learner_fixtures import config, make_trees, on_policy

from actors.policy.tiny_model import build_tiny_model
from learner.forward import token_logprobs
from learner.learner import Learner
from learner.packing import pack_trees

pytestmark = pytest.mark.gpu
BIG = {"prompt": (6, 10), "turn": (4, 8), "obs": (3, 5), "turns": (2, 4)}
GPU = {"resources": {"learner": {"num_gpus": 1}}}


@pytest.fixture(scope="module")
def group():
    """A 1-rank NCCL process group for this module (rank 0 hosts its own TCP store)."""
    import torch.distributed as dist

    from learner.distributed import init_process_group

    torch.backends.cuda.matmul.allow_tf32 = False  # equivalence checks in true fp32
    torch.backends.cudnn.allow_tf32 = False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_process_group(0, 1, "127.0.0.1", port, 120.0, torch.device("cuda", 0))
    assert dist.get_backend() == "nccl"
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def setup(tok):
    model = build_tiny_model(tok, hidden=128, layers=2, heads=4, kv_heads=2, seed=3)
    return model, on_policy(model, make_trees(tok, n=4, seed=9, **BIG))


def sharded(model, tok, **learner_keys):
    from learner.sharded import sharded_learner

    cfg = config(learner={"minibatches": 1, "ranks": 1, **learner_keys}, **GPU)
    return sharded_learner(copy.deepcopy(model), cfg, tokenizer=tok)


def test_fsdp2_fp32_step_on_cuda_equals_the_plain_learner(group, setup, tok):
    from learner.distributed import is_sharded

    model, trees = setup
    learner = sharded(model, tok, tree_attention="chunked")
    assert is_sharded(learner.model) and next(learner.model.parameters()).device.type == "cuda"
    got = learner.step(trees)
    ref = Learner(
        copy.deepcopy(model), config(learner={"minibatches": 1, "tree_attention": "chunked"}, **GPU)
    )
    want = ref.step(trees)
    assert got["learner/loss"] == pytest.approx(want["learner/loss"], abs=1e-5)
    weights = learner.named_weights()
    diff = max(float((weights[n].cuda() - p).abs().max()) for n, p in ref.model.named_parameters())
    assert diff <= 1e-5


def test_fsdp2_bf16_step_checkpoint_and_export(group, setup, tok, tmp_path):
    from transformers import AutoModelForCausalLM

    from launch.cmd_export import export_checkpoint, find_checkpoint
    from storage.dcp_checkpoint import full_model_tensors

    model, trees = setup
    learner = sharded(model, tok, precision="bfloat16", grad_checkpointing=True, max_tokens_per_microbatch=60)
    stats = [learner.step(trees) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(s["learner/loss"])) for s in stats)
    assert stats[0]["learner/microbatches"] >= 3
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())  # fp32 master shards
    assert {w.dtype for w in learner.named_weights().values()} == {torch.bfloat16}  # weights.dtype auto
    learner.save(tmp_path, extra={"watermark": 2})
    ckpt = find_checkpoint(tmp_path)
    assert ckpt.meta["format"] == 2 and ckpt.step == 2
    folder = export_checkpoint(ckpt, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    full = full_model_tensors(ckpt)  # the fp32 master weights as trained
    assert all(torch.equal(full[n], p) for n, p in exported.state_dict().items())
    plain = copy.deepcopy(model)
    plain.load_state_dict(full)
    packed = pack_trees(trees, concat=True)
    with torch.no_grad():
        a, b = token_logprobs(exported.eval(), packed), token_logprobs(plain.eval(), packed)
    assert float((a - b).abs().max()) <= 1e-5
