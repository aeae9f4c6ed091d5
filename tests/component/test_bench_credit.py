"""`treeopsd bench credit`'s core on a scripted backend: every setting sampled, labelled, scored; the JSON
has the documented keys and every AUC lies in its bootstrap interval (a few seconds, no model)."""

import json

import numpy as np

from actors.sampler_setup import load_split
from benchmarks import bench_credit
from configs.schema import load_config
from tests.fakes import ScriptedBackend

POOLED = ("credit_auc_treeopsd", "credit_auc_grpo", "credit_auc_treepo", "treeopsd_minus_grpo")


def _backend(model_dir, base, n_trees):
    from actors.sampler_setup import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    tasks = [
        t
        for h in bench_credit.HOPS
        for t in load_split(bench_credit.setting_config(base, (4, 2), h), "train")[:n_trees]
    ]

    def qa(context):  # the scripted menu searches the question's first hop and may answer right
        text = tokenizer.decode(context)
        task = next(t for t in tasks if t.question in text)
        return f"{task.meta['chain'][0]} {task.meta['path'][0]}", task.answers[0]

    return ScriptedBackend(tokenizer, seed=0, question_answer=qa)


def _check_group(group):
    for key in POOLED:
        assert group[key] is not None, key
        assert group[f"{key}_lo"] <= group[key] <= group[f"{key}_hi"], key
    for name in bench_credit.METHODS:
        value = group[f"credit_auc_{name}"]
        assert value is None or group[f"credit_auc_{name}_lo"] <= value <= group[f"credit_auc_{name}_hi"]
        assert f"credit_auc_{name}_within" in group
    assert group["trees"] > 0 and group["turns"] >= group["progress_turns"] > 0
    assert 0.0 < group["progress_rate"] < 1.0


def test_bench_core_on_scripted_trees(tiny_model_dir):
    base = load_config(None, ["logging.progress=false"])
    n_trees = 3
    lines = []
    backend = _backend(tiny_model_dir, base, n_trees)
    records = bench_credit.collect(base, tiny_model_dir, backend, n_trees, log=lines.append)
    assert len(records) == 9 * n_trees and len(lines) == 9
    assert {(r.shape, r.hops) for r in records} == {(s, h) for s in ("4,2", "2,6", "8,0") for h in (2, 4, 6)}
    for r in records:
        assert all(s.shape == r.labels.shape for s in r.signals.values())
        if r.shape == "8,0":  # unbranched: V_i is the owner's z, exactly GRPO's broadcast
            np.testing.assert_allclose(r.signals["treeopsd"], r.signals["grpo"], atol=1e-12)
    out = bench_credit.summarize(records, n_boot=200, seed=0)
    json.dumps(out)  # plain JSON types only
    _check_group(out)
    assert out["trees"] == 9 * n_trees and out["n_boot"] == 200
    assert set(out["by_shape"]) == {"4,2", "2,6", "8,0"} and set(out["by_hops"]) == {"2", "4", "6"}
    assert len(out["by_setting"]) == 9
    for group in [*out["by_shape"].values(), *out["by_hops"].values()]:
        _check_group(group)
    assert sum(g["turns"] for g in out["by_setting"].values()) == out["turns"]
    assert out == bench_credit.summarize(records, n_boot=200, seed=0)  # seeded
