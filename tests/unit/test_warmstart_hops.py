"""`model.warmstart_hops`: the hop counts the tiny model is warm-started on, part of its cache key only when
not the default (every cached default model stays valid), and one warm start per setting in a grid."""

from __future__ import annotations

import hashlib
import json

import actors.policy.warmstart as warmstart_module
from actors.envs.synthetic_kb import SyntheticKBEnv
from configs.schema import load_config
from experiments.grid import load_spec, plan, resolved_config, warm_key
from runtime.model_setup import tiny_model_dir


def test_the_default_range_keeps_the_cache_folder_and_another_gets_its_own(tmp_path):
    base = load_config(None, [f"run.run_dir={tmp_path}/run"])
    # the reference: the folder's digest over the settings every earlier version hashed (no "hops")
    settings = {"recipe": warmstart_module.RECIPE_VERSION, "steps": 1200, "seed": 0}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    assert tiny_model_dir(base) == tmp_path / "models" / f"tiny-{digest}"
    same = load_config(None, [f"run.run_dir={tmp_path}/run", "model.warmstart_hops=[2,4]"])
    longer = load_config(None, [f"run.run_dir={tmp_path}/run", "model.warmstart_hops=[2,6]"])
    assert tiny_model_dir(same) == tiny_model_dir(base)
    assert tiny_model_dir(longer) != tiny_model_dir(base)


def test_the_warm_start_trains_on_its_hops_and_a_default_run_stays_cached(tmp_path, monkeypatch):
    seen: list[dict] = []

    def fake_train(out, cfg, progress):  # what the SFT would be given; no training here
        seen.append(cfg)
        out.mkdir(parents=True)  # as saving the model would
        return {"success": 0.0}

    monkeypatch.setattr(warmstart_module, "_train_and_evaluate", fake_train)
    knobs = {"steps": 7, "seed": 0, "n_train": 6000, "batch_size": 16, "lr": 3e-3}
    _, default_digest = warmstart_module._settings(**knobs, warmup=50, schedule="cosine", eval_per_hop=40)
    out = tmp_path / "cached"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"")
    (out / "warmstart.json").write_text(json.dumps({"settings_hash": default_digest, "success": 0.5}))
    hit = warmstart_module.warmstart(out, steps=7, hops=(2, 4), progress=False)
    assert hit["cached"] and hit["success"] == 0.5 and not seen  # an earlier default warm start is reused

    report = warmstart_module.warmstart(tmp_path / "long", steps=7, hops=(2, 6), progress=False)
    assert not report["cached"] and seen[0]["hops"] == [2, 6] and report["settings"]["hops"] == [2, 6]
    assert report["settings_hash"] != default_digest


def test_the_sft_questions_are_a_prefix_and_a_narrow_range_gives_all_it_has():
    env = SyntheticKBEnv()
    default = warmstart_module.sft_questions(env, (2, 4), 6000)
    assert [t.meta["path"] for t in default] == [
        t.meta["path"] for t in env.tasks("train", n=6000, hops=(2, 4))
    ]
    two = warmstart_module.sft_questions(env, (2, 2), 6000)
    assert len(two) == len(env.tasks("train", hops=(2, 2))) < 6000  # every 2-hop question there is
    assert {t.meta["hops"] for t in two} == {2}


def test_each_horizon_of_the_sweep_starts_from_its_own_warm_start():
    spec = load_spec("configs/horizon_sweep.yaml")
    keys = {row.name: warm_key(spec, row, 0) for row in spec.rows}
    by_horizon = {h: {k for name, k in keys.items() if name.startswith(f"{h}-hop")} for h in (3, 5, 7)}
    assert all(len(k) == 1 for k in by_horizon.values())  # one start per horizon, shared by its 4 rows
    assert len(set.union(*by_horizon.values())) == 3
    assert warm_key(spec, spec.rows[0], 2) == keys[spec.rows[0].name]  # one warm-start seed for all seeds
    five = resolved_config(spec, next(r for r in spec.rows if r.name.startswith("5-hop")), 0)
    assert five.model.warmstart_hops == (2, 4) and five.env.train_hops == (4, 5)  # the paper table's start
    seven_row = next(r for r in spec.rows if r.name.startswith("7-hop"))
    seven = resolved_config(spec, seven_row, 0)
    assert (seven.model.warmstart_hops, seven.env.train_hops, seven.env.eval_hops) == ((2, 6), (6, 7), (7, 7))
    assert (five.model.warmstart_steps, seven.model.warmstart_steps) == (1200, 2400)
    ablations = load_spec("configs/horizon_ablations.yaml")
    assert {warm_key(ablations, row, 0) for row in ablations.rows} == {keys[seven_row.name]}  # its start
    runs = plan(spec)
    # 12 rows x 3 seeds; the untrained rows' 9 runs evaluate only; every trained row costs 8 (M(1+N/2), G)
    assert len(runs) == 36 and sum(not r.train for r in runs) == 9
    assert {resolved_config(spec, row, 0).algo.expected_cost for row in spec.rows if row.train} == {8.0}
