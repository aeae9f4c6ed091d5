"""LoRA in the learner (learner/lora.py, `learner.lora.*`) on the tiny Qwen2 model: the step against a
reference built here, the optimizer's parameters, exact save → resume, merged weights in a plain HF model,
refusals of a foreign adapter and of bad config values."""

import json

import pytest
import torch
from learner_fixtures import config, make_trees
from torch import nn
from torch.nn.utils import parametrize
from transformers import AutoModelForCausalLM

from actors.policy.tiny_model import build_tiny_model
from configs.schema import ConfigError, load_config
from launch.cmd_export import export_checkpoint, find_checkpoint
from learner import lora
from learner.forward import token_logprobs
from learner.learner import Learner
from learner.packing import pack_tree, pack_trees

torch.set_num_threads(1)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_config(rank=4, alpha=8.0, dropout=0.0, targets=PROJ, **learner):
    # one mini-batch and no clipping: the step's gradient is the one left on the parameters after it
    adapters = {"rank": rank, "alpha": alpha, "dropout": dropout, "target_modules": list(targets)}
    return config(
        learner={"minibatches": 1, "grad_clip": 0.0, "lora": adapters, **learner},
        algo={"proximal": "behavior"},
    )


def nonzero_b(model, seed=0):
    """B away from its zero init (A's gradient is B-weighted: zero at init), seeded."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.05)


def base_params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def opt_state(optimizer):
    return {pid: {k: v.clone() for k, v in st.items()} for pid, st in optimizer.state_dict()["state"].items()}


class LowRank(nn.Module):
    """The reference's adapter: a parametrization of a plain Linear's weight, W ↦ W + scale·B·A (the merged
    form, not LoRALinear's x·Aᵀ·Bᵀ path)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.A, self.B, self.scale = nn.Parameter(a.clone()), nn.Parameter(b.clone()), scale

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.scale * (self.B @ self.A)


def test_step_matches_a_reference_and_leaves_the_base_bit_for_bit(tok):
    trees = make_trees(tok, n=3, seed=10)
    learner = Learner(build_tiny_model(tok, seed=1), lora_config())
    nonzero_b(learner.model)
    layers = lora.lora_layers(learner.model)
    assert len(layers) == 14 and {n.rsplit(".", 1)[-1] for n in layers} == set(PROJ)  # 2 layers × 7

    ref_model = build_tiny_model(tok, seed=1).requires_grad_(False)  # the same base, plain, frozen
    adapters = {}
    for name, layer in layers.items():  # same A, B as the LoRA model's, as parametrizations
        adapters[name] = LowRank(layer.lora_A.detach(), layer.lora_B.detach(), layer.scaling)
        parametrize.register_parametrization(ref_model.get_submodule(name), "weight", adapters[name])
    reference = Learner(
        ref_model, config(learner={"minibatches": 1, "grad_clip": 0.0}, algo={"proximal": "behavior"})
    )
    assert {id(p) for g in reference.optimizer.param_groups for p in g["params"]} == {
        id(p) for a in adapters.values() for p in (a.A, a.B)
    }

    before = base_params(learner.model)
    got, want = learner.step(trees), reference.step(trees)
    assert got["learner/loss"] == pytest.approx(want["learner/loss"], rel=1e-6, abs=0)
    grad_gap = max(
        max(
            float((layer.lora_A.grad - adapters[n].A.grad).abs().max()),
            float((layer.lora_B.grad - adapters[n].B.grad).abs().max()),
        )
        for n, layer in layers.items()
    )
    grad_size = max(float(a.A.grad.abs().max()) for a in adapters.values())
    assert grad_gap <= 1e-6 and grad_size > 1e-4, (grad_gap, grad_size)  # gradients: equal, and not zero
    # and the AdamW step that follows: its first update is lr·g/(|g| + eps), which turns the rounding of
    # near-zero gradients into up to ~lr/1000 here (lr = 3e-3)
    step_gap = max(float((layer.lora_A - adapters[n].A).detach().abs().max()) for n, layer in layers.items())
    assert step_gap <= 1e-5, step_gap
    after = base_params(learner.model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # the base: untouched, bit for bit
    assert all(p.grad is None for n, p in learner.model.named_parameters() if "lora_" not in n)


def test_microbatches_the_mask_path_and_bf16_train_the_one_shot_gradient(tok):
    """The adapters' gradients through the learner's other paths equal the one-shot chunked-plan step's:
    micro-batches under a 24-token budget (trees cut into pieces), the dense-mask attention ("mask": the
    model's own sdpa with the 4D tree mask), and bf16 autocast up to bf16 rounding (FlexAttention has no CPU
    backward: its forward is checked here, the eager kernel)."""
    trees = make_trees(tok, n=3, seed=16)

    def step(attention="tree", **learner_keys):
        torch.manual_seed(0)  # the same A everywhere
        learner = Learner(build_tiny_model(tok, seed=7), lora_config(**learner_keys), attention=attention)
        nonzero_b(learner.model, seed=1)
        stats = learner.step(trees)
        grads = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.requires_grad}
        assert len(grads) == 28 and all(
            p.grad is None for p in learner.model.parameters() if not p.requires_grad
        )
        return stats, grads

    ref_stats, ref = step()
    assert ref_stats["learner/microbatches"] == 1
    cases = {
        "micro-batches": (step(max_tokens_per_microbatch=24), 1e-5),  # measured: 7.7e-7
        "mask": (step("mask"), 1e-5),
        "bf16": (step(precision="bfloat16"), 5e-2),  # measured: 1.7e-2
    }
    for case, ((stats, grads), tol) in cases.items():
        gap = max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in ref.items())
        assert gap <= tol, (case, gap)
        assert stats["learner/loss"] == pytest.approx(ref_stats["learner/loss"], rel=tol, abs=1e-6), case
    assert cases["micro-batches"][0][0]["learner/microbatches"] >= 4  # the trees were split
    adapted = Learner(build_tiny_model(tok, seed=7), lora_config()).model  # flex: forward only on the CPU
    nonzero_b(adapted, seed=1)
    packed = pack_trees(trees, concat=True)
    with torch.no_grad():
        flex, chunked = token_logprobs(adapted, packed, "flex"), token_logprobs(adapted, packed, "tree")
        base = token_logprobs(build_tiny_model(tok, seed=7), packed, "tree")
    torch.testing.assert_close(flex, chunked, atol=1e-5, rtol=0)
    assert float((chunked - base).abs().max()) > 1e-3  # and the adapters count in it


def test_only_adapters_are_in_the_optimizer(tok):
    learner = Learner(build_tiny_model(tok, seed=2), lora_config(rank=2))
    params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    trained = {n: p for n, p in learner.model.named_parameters() if p.requires_grad}
    assert {id(p) for p in params} == {id(p) for p in trained.values()} and len(params) == 28
    assert all(n.endswith((".lora_A", ".lora_B")) for n in trained)
    # r·(in + out) per projection: q 64+64, k and v 64+32, o 64+64, gate and up 64+256, down 256+64
    assert sum(p.numel() for p in params) == 2 * 2 * (128 + 96 + 96 + 128 + 320 + 320 + 320)  # r=2, 2 layers
    learner.step(make_trees(tok, seed=11))
    state = learner.optimizer.state_dict()["state"]
    assert len(state) == 28  # AdamW moments for the adapters only, none for the frozen base
    assert [v["exp_avg"].shape for v in state.values()] == [p.shape for p in params]


def test_save_restore_is_exact_and_resumes_the_same_step(tok, tmp_path):
    trees, trees2 = make_trees(tok, seed=12), make_trees(tok, seed=13)
    cfg = lora_config(dropout=0.1)  # dropout draws from the RNG: the resume must restore it too
    a = Learner(build_tiny_model(tok, seed=5), cfg)
    a.step(trees)
    path = a.save(tmp_path, step=1, extra={"watermark": 3}, tokenizer=tok)
    saved, saved_opt = {k: v.clone() for k, v in lora.adapter_state(a.model).items()}, opt_state(a.optimizer)
    merged_at_save = lora.merged_state(a.model)
    a.step(trees2)  # the run goes on ...

    b = Learner(build_tiny_model(tok, seed=5), cfg)  # ... a restarted learner: the same base, new adapters
    fresh = lora.adapter_state(b.model)  # A as a's started (the same seeded RNG), B zero: a's B has moved
    assert not all(torch.equal(fresh[k], saved[k]) for k in saved)
    ckpt = b.restore(tmp_path)
    assert ckpt is not None and ckpt.step == 1 and b.version == 1
    restored = lora.adapter_state(b.model)
    assert restored.keys() == saved.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
    got_opt = opt_state(b.optimizer)
    assert got_opt.keys() == saved_opt.keys() and len(got_opt) == 28
    assert all(torch.equal(saved_opt[i][k], got_opt[i][k]) for i in saved_opt for k in saved_opt[i])
    b.step(trees2)
    final_a, final_b = lora.adapter_state(a.model), lora.adapter_state(b.model)
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)  # the next step: bit for bit
    assert all(
        torch.equal(x, y)
        for x, y in zip(base_params(a.model).values(), base_params(b.model).values(), strict=True)
    )

    meta = json.loads((path / "meta.json").read_text())["lora"]
    assert meta == {
        "base_fingerprint": lora.base_fingerprint(build_tiny_model(tok, seed=5)),
        "rank": 4,
        "alpha": 8.0,
        "dropout": 0.1,
        "layers": 14,
    }
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)  # the checkpoint's model: merged
    assert all(torch.equal(v, merged_at_save[k]) for k, v in hf.state_dict().items())
    out = export_checkpoint(find_checkpoint(tmp_path, step=1), tmp_path / "export")  # `treeopsd export`
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).state_dict()
    assert exported.keys() == merged_at_save.keys()
    assert all(torch.equal(v, merged_at_save[k]) for k, v in exported.items())


def test_merged_state_in_a_plain_model_gives_the_same_logprobs(tok):
    trees = make_trees(tok, n=2, seed=14)
    learner = Learner(build_tiny_model(tok, seed=3), lora_config(alpha=16.0, lr=1e-2))
    for _ in range(3):
        learner.step(trees)  # B learned, away from zero
    merged = lora.merged_state(learner.model)
    plain = build_tiny_model(tok, seed=99)  # another init: everything comes from `merged`
    plain.load_state_dict(merged, strict=True)
    base = build_tiny_model(tok, seed=3)
    gaps, moved = [], []
    for tree in trees:
        packed = pack_tree(tree)
        with torch.no_grad():
            got, want = token_logprobs(plain, packed), token_logprobs(learner.model, packed)
            moved.append(float((want - token_logprobs(base, packed)).abs().max()))
        gaps.append(float((got - want).abs().max()))
    assert max(gaps) <= 1e-5 and max(moved) > 1e-3, (gaps, moved)  # the same model, and not the base
    served = learner.named_weights()  # what the samplers get: the merged weights under the base's names
    assert served.keys() == dict(base.named_parameters()).keys()
    assert all(torch.equal(served[k], merged[k]) for k in served)


def test_a_foreign_adapter_or_checkpoint_is_refused_in_one_line(tok, tmp_path):
    a = Learner(build_tiny_model(tok, seed=5), lora_config())
    nonzero_b(a.model)
    a.save(tmp_path, step=1)
    cases = {
        "another base": (
            Learner(build_tiny_model(tok, seed=6), lora_config()),
            "trained on another base model",
        ),
        "another rank": (
            Learner(build_tiny_model(tok, seed=5), lora_config(rank=2)),
            "has rank 4, this model's has 2",
        ),
        "another alpha": (
            Learner(build_tiny_model(tok, seed=5), lora_config(alpha=4.0)),
            "has alpha 8.0, this model's has 4.0",
        ),
        "a full run": (
            Learner(build_tiny_model(tok, seed=5), config()),
            "resume it with learner.lora.rank = 4",
        ),
    }
    for case, (learner, why) in cases.items():
        before = {k: v.clone() for k, v in learner.model.state_dict().items()}
        with pytest.raises(lora.LoraError, match=why) as info:
            learner.restore(tmp_path)
        assert "\n" not in str(info.value), case
        after = learner.model.state_dict()
        assert all(torch.equal(v, after[k]) for k, v in before.items()), case  # refused before any load
    full = tmp_path / "full"
    Learner(build_tiny_model(tok, seed=5), config()).save(full, step=1)
    with pytest.raises(lora.LoraError, match=r"holds no LoRA adapter .*learner\.lora\.rank = 0$"):
        Learner(build_tiny_model(tok, seed=5), lora_config()).restore(full)

    other = Learner(build_tiny_model(tok, seed=6), lora_config()).model  # an adapter handed over directly
    state, meta = lora.adapter_state(a.model), lora.adapter_meta(a.model)
    with pytest.raises(lora.LoraError) as info:
        lora.load_adapter(other, state, meta, "adapter.safetensors")
    kept, live = meta["base_fingerprint"], lora.base_fingerprint(other)
    assert kept != live and str(info.value) == (
        f"adapter.safetensors: the LoRA adapter was trained on another base model (fingerprint {kept}, "
        f"this model's is {live}); use the base it was trained on (the run's model.path)"
    )
    same = Learner(build_tiny_model(tok, seed=5), lora_config()).model
    lora.load_adapter(same, state, meta, "adapter.safetensors")  # the same base: loaded
    assert all(torch.equal(v, lora.adapter_state(same)[k]) for k, v in lora.adapter_state(a.model).items())


BAD = [
    ("learner.lora.rank=-1", "learner.lora.rank = -1 is invalid: expected an integer >= 0"),
    ("learner.lora.rank=2.5", "learner.lora.rank = 2.5 is invalid: expected an integer >= 0"),
    ("learner.lora.rank='8'", "learner.lora.rank = '8' is invalid: expected an integer >= 0"),
    ("learner.lora.alpha=0", "learner.lora.alpha = 0.0 is invalid: expected a number > 0"),
    ("learner.lora.alpha=-16", "learner.lora.alpha = -16.0 is invalid: expected a number > 0"),
    ("learner.lora.alpha=.nan", "learner.lora.alpha = nan is invalid: expected a number > 0"),
    ("learner.lora.dropout=1", "learner.lora.dropout = 1.0 is invalid: expected a number in [0, 1)"),
    (
        "learner.lora.target_modules=[]",
        "learner.lora.target_modules = [] is invalid: expected a non-empty list of module-name suffixes "
        "such as [q_proj, v_proj] (names of nn.Linear layers)",
    ),
]


@pytest.mark.parametrize(("override", "message"), BAD, ids=[o for o, _ in BAD])
def test_bad_rank_alpha_and_targets_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["learner.lora.rank=4", override])
    assert str(info.value) == message


def test_lora_config_defaults_and_rules(tok):
    cfg = load_config()
    assert cfg.learner.lora.rank == 0 and cfg.learner.lora.target_modules == PROJ  # off by default
    model = build_tiny_model(tok, seed=4)
    assert lora.apply_lora(model, cfg.learner.lora) is model and not lora.lora_layers(model)
    sharded = load_config(overrides=["learner.lora.rank=4", "learner.ranks=2"])  # FSDP2 ranks take LoRA too
    assert (sharded.learner.lora.rank, sharded.learner.ranks) == (
        4,
        2,
    )  # (tests/component/test_lora_sharded.py)
    with pytest.raises(lora.LoraError) as info:
        Learner(build_tiny_model(tok), lora_config(targets=["c_attn"]))
    assert str(info.value) == (
        "learner.lora.target_modules = ['c_attn'] matches no nn.Linear of this model (its Linear layers are "
        "named down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj)"
    )
