"""Helpers of the sharded-learner tests: a config, a store actor holding credited batches, a learner group,
and the one-process reference they are compared with (the same tiny model, the same trees)."""

from __future__ import annotations

import torch
from learner_fixtures import make_trees, on_policy

from configs.schema import Config, parse_config, to_dict
from system.roles import LearnerRole

B = 4  # trees per batch


def group_cfg(run_dir, method="treeopsd", ranks=2, cpus=1, **learner) -> Config:
    data = {
        "run": {"run_dir": str(run_dir), "seed": 3},
        "algo": {"method": method, "rho": 0.4},
        "learner": {"batch_trees": B, "minibatches": 2, "lr": 3e-4, "ranks": ranks, **learner},
        "resources": {"learner": {"num_cpus": cpus}},
    }
    return parse_config(data)


def load_tiny(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def batches(model, tok, n_batches: int, seed: int = 11) -> list[list]:
    """`n_batches` batches of B credited trees, on-policy for `model` (trees of 1-3 turns per path)."""
    trees = on_policy(model, make_trees(tok, n=B * n_batches, seed=seed))
    return [trees[k * B : (k + 1) * B] for k in range(n_batches)]


def store_with(path, trees):
    """A store actor holding `trees` credited, in this order (take_batch hands them out in it)."""
    from runtime.roles import start_store_actor
    from storage.replay_store_actor import RemoteStore

    handle = start_store_actor(str(path), eta=1, batch_size=B)
    RemoteStore(handle).put_credited(trees)
    return handle


def start_group(cfg: Config, model_dir, store, resume=False):
    from runtime.driver import role_options
    from runtime.roles import start_learner_group

    return start_learner_group(cfg, to_dict(cfg), model_dir, store, resume, role_options(cfg, "learner"))


def train(group, timeout_s=300.0) -> dict[str, float]:
    out = group.wait(group.call(LearnerRole.train_step, 0.05), timeout_s=timeout_s)
    assert out is not None, "the store held no batch"
    return out


def reference(model_dir, cfg: Config):
    """The one-process Learner on the same model (learner.ranks is ignored by it)."""
    from learner.learner import Learner

    model, tok = load_tiny(model_dir)
    return Learner(model, cfg, tokenizer=tok)


def max_diff(state: dict[str, torch.Tensor], model) -> float:
    live = model.state_dict()
    assert set(live) <= set(state), sorted(set(live) - set(state))
    return max(float((state[k].float() - live[k].float()).abs().max()) for k in live)
