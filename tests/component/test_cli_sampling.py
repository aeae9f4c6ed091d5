"""`treeopsd rollout` and `treeopsd eval` end to end on the HF backend with a tiny random model.

In-process through `launch.cli.main`, except one subprocess that runs the installed console script.
A random-init model rarely emits a stop token, so its episodes end after one (truncated) turn: the trees
here have M leaves and no branches; test_hf_trees.py covers branching on the same backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.cli import main

SMALL = ["algo.M=2", "algo.N=1", "env.max_turn_tokens=8", "env.max_turns=2", "logging.progress=false"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random-init tiny Qwen2 with a BPE tokenizer trained on a small synthetic KB (any text works)."""
    from actors.envs.synthetic_kb import KBConfig, SyntheticKBEnv, tokenizer_texts
    from actors.policy.tiny_model import save_tiny

    env = SyntheticKBEnv(config=KBConfig(n_persons=40, n_companies=10, n_cities=12, n_countries=5))
    texts = tokenizer_texts(env, n_questions=200, n_oracle=20)
    return str(save_tiny(tmp_path_factory.mktemp("tiny"), texts, seed=0))


def test_rollout_fills_store_with_valid_trees(tiny_model: str, tmp_path: Path, capsys) -> None:
    from storage.replay_store import ReplayStore
    from storage.store_verify import verify_store

    store = tmp_path / "store"
    argv = ["rollout", "--prompts", "3", "--store", str(store), "--chunk", "2", "--json"]
    assert main([*argv, f"model.path={tiny_model}", *SMALL]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["trees"] == 3 and summary["store_trees"] == 3
    assert summary["leaves"] == 3 * 2  # M = 2 initial trajectories; one-turn episodes leave no anchors
    assert summary["sampled_tokens"] > 0 and summary["seconds"] > 0
    assert verify_store(store).ok
    with ReplayStore(store, create=False, readonly=True) as s:
        ids = s.tree_ids("raw")
        trees = s.get_trees(ids)  # decodes and validates every tree
    assert len(ids) == 3 and len(set(ids)) == 3
    assert all(t.num_leaves >= 2 and all(n.policy_version == 0 for n in t.nodes) for t in trees)
    assert all(json.loads(t.meta["answers"]) for t in trees)


def test_eval_json_on_tiny_model(tiny_model: str, capsys) -> None:
    argv = ["eval", "--model", tiny_model, "--limit", "4", "--json", *SMALL]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 4 and report["backend"] == "hf"
    # a random-init model never reaches an answer in 8 tokens (its turns are truncated): every score is 0
    assert (report["success"], report["em"], report["f1"]) == (0.0, 0.0, 0.0)
    kb = report["datasets"]["synthetic_kb"]
    assert kb["n"] == 4 and set(kb["per_hop"]) == {"4", "5"}  # --limit keeps every hop count (default: 4–5)


def test_eval_bad_data_file_names_the_file(tiny_model: str, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"question": "q", "golden_answers": ["a"]}\n{"question": \n')
    argv = ["eval", "--model", tiny_model, "--data", str(bad), "env.name=multihop_qa"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "line 2" in err
    missing = tmp_path / "missing.json"
    assert main(["eval", "--model", tiny_model, "--data", str(missing), "env.name=multihop_qa"]) == 2
    assert str(missing) in capsys.readouterr().err


def test_eval_missing_model_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert main(["eval", "--model", str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_unknown_override_fails_before_anything_starts(tmp_path: Path) -> None:
    """Through the installed console script; the config is checked before any model or store is touched."""
    script = Path(sys.executable).with_name("treeopsd")
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    store = tmp_path / "store"
    argv = [str(script), "rollout", "--prompts", "2", "--store", str(store), "algo.bogus=1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert proc.returncode == 2
    assert "unknown key algo.bogus" in proc.stderr
    assert not store.exists()
