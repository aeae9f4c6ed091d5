"""`treeopsd bench learner --device cpu --shape tiny`: the GPU benchmark's code (benchmarks/learner_gpu.py)
dry-run on the CPU, as CI can (no GPU): both layouts on the same trees, the path-equivalent rate, the memory
model's arithmetic, and one clear line for a bad flag."""

from argparse import Namespace

import pytest

from benchmarks.learner_gpu import SHAPES, model_bytes, run
from launch.cli import main


@pytest.fixture(scope="module")
def result():
    return run(Namespace(device="cpu", shape="tiny", steps=2))


def test_both_layouts_train_the_same_trees(result):
    packed, paths = result["tiny"]["packed"], result["tiny"]["paths"]
    # the same draws: the paths layout forwards exactly the trees' root-to-leaf tokens, packing fewer
    assert paths["tokens_per_step"] == paths["path_tokens_per_step"] == packed["path_tokens_per_step"]
    assert packed["tokens_per_step"] < packed["path_tokens_per_step"]
    # path-equivalent rate = the paths' tokens over the packed step's time, so it beats the packed rate by
    # exactly the tokens ratio (up to the rounding of both)
    ratio = packed["path_tokens_per_step"] / packed["tokens_per_step"]
    assert packed["path_tokens_per_s"] == pytest.approx(packed["tokens_per_s"] * ratio, rel=1e-3)
    assert packed["attention"] == "tree" and packed["pad_frac"] == 0.0  # the CPU: chunked plan, no buckets
    assert result["tiny"]["packed_over_paths"]["step_speedup"] == pytest.approx(
        paths["step_s"] / packed["step_s"], abs=2e-3
    )


def test_memory_model_by_hand():
    # qwen3-4b: 4,022,468,096 parameters × 16 bytes (fp32 weights, grads, two AdamW moments) = 59.94 GiB;
    # checkpoints 4 · 16384 · 2560 · 36 bytes = 5.625 GiB; LM head 3 · 4 · 2048 · 151936 bytes = 3.48 GiB
    got = model_bytes("qwen3-4b", 4_022_468_096, 16_384, 2048)
    assert got["model_states_gib"] == 59.94 and got["model_checkpoints_gib"] == 5.62
    assert got["model_lm_head_gib"] == 3.48
    # one layer: 2 · 2 · 16384 · (3·2560 + 2·4096 + 2·1024 + 3·9728) bytes = 2.88 GiB
    assert got["model_layer_gib"] == 2.88 and SHAPES["qwen3-4b"] == (2560, 9728, 36, 32, 8)


def test_bad_shape_is_one_line(capsys):
    assert main(["bench", "learner", "--device", "cpu", "--shape", "qwen9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"treeopsd bench learner: --shape 'qwen9' is not one of {sorted(SHAPES)}"
