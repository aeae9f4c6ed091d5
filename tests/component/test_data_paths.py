"""Real data paths from the CLI: BrowseComp-Plus decryption (`treeopsd data decrypt-browsecomp`), qrels
retrieval recall in evaluation (hand-worked on the fixture corpus), and model paths that are not models:
one line naming the path and what is accepted, in eval, train and warmstart, with no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import fixtures_data as fx
import pytest

from actors.agent_loop import Episode
from actors.envs import load_tasks, make_env
from actors.envs.tool_calls import ToolCall
from experiments.retrieval_recall import attach_qrels, episode_recall, gold_ids
from launch.cli import main
from runtime.model_setup import ModelPathError, check_model_path

ACCEPTED = "a Hugging Face causal-LM folder (config.json, *.safetensors, a tokenizer) or a .gguf file"


def test_decrypt_browsecomp_from_the_cli(tmp_path, capsys):
    enc = fx.write_browsecomp_queries(tmp_path, encrypted=True, canary_field=True)
    out = tmp_path / "plain.jsonl"
    assert main(["data", "decrypt-browsecomp", str(enc), str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [{**q, "canary": fx.CANARY} for q in fx.BC_QUERIES]  # every string back, keys kept
    assert "decrypted 2 queries" in capsys.readouterr().out
    bare = fx.write_browsecomp_queries(tmp_path / "bare", encrypted=True)  # no canary field: pass it
    assert main(["data", "decrypt-browsecomp", str(bare), str(out), "--canary", fx.CANARY]) == 0
    tasks = load_tasks("deep_research", path=out)  # the output reads as plain queries
    assert tasks[0].question == fx.BC_QUERIES[0]["query"] and tasks[0].answers == ("Lake Vostok",)
    assert main(["data", "decrypt-browsecomp", str(bare), str(out), "--canary", "wrong"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bare) in err[0] and "line 1" in err[0] and "cannot decrypt 'query'" in err[0]


def _episode(task, queries):
    return Episode(task, None, 0, [], [ToolCall("search", {"query": q}) for q in queries], 0, key="k")


def test_retrieval_recall_against_qrels_hand_worked(tmp_path):
    env = make_env("deep_research", corpus=fx.write_browsecomp_corpus(tmp_path), topk=1)
    q784, q785 = load_tasks("deep_research", path=fx.write_browsecomp_queries(tmp_path))
    assert gold_ids(q784) == {"101"} and gold_ids(q785) == set()  # the query's own evidence docs
    eps = [_episode(q784, ["1996 survey Lake Vostok"]), _episode(q784, ["penguins"]), _episode(q785, ["x"])]
    assert episode_recall(env, eps) == [1.0, 0.0, None]  # top-1 hits: 101; 102; and 785 has no gold docs
    from actors.envs.deep_research import load_qrels

    with_qrels = attach_qrels([q784, q785], load_qrels(fx.write_qrels(tmp_path)))  # 784: {101}; 785: {103}
    assert gold_ids(with_qrels[1]) == {"103"}
    eps = [
        _episode(with_qrels[0], ["penguins", "1996 survey"]),
        _episode(with_qrels[1], ["expedition archive"]),
    ]
    assert episode_recall(env, eps) == [1.0, 1.0]
    assert episode_recall(env, [_episode(with_qrels[1], [])]) == [0.0]  # never searched: nothing retrieved


def test_eval_reports_recall_with_qrels(tmp_path, capsys, tiny_model_dir):
    corpus, queries = fx.write_browsecomp_corpus(tmp_path), fx.write_browsecomp_queries(tmp_path)
    argv = [
        "eval",
        "--model",
        tiny_model_dir,
        "--data",
        str(queries),
        "--qrels",
        str(fx.write_qrels(tmp_path)),
    ]
    opts = ["env.name=deep_research", f"env.corpus={corpus}", "env.max_turn_tokens=8", "env.max_turns=2"]
    assert main([*argv, "--json", *opts, "logging.progress=false"]) == 0
    report = json.loads(capsys.readouterr().out)["datasets"]["browsecomp_plus"]
    # a random-init model never writes a search line: no gold document of the 2 tasks was retrieved
    assert report["recall_tasks"] == 2 and report["retrieval_recall"] == 0.0


def test_model_paths_that_are_not_models(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "notemplate").mkdir()  # a base model's folder: weights and a tokenizer, no chat template
    (tmp_path / "notemplate" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "notemplate" / "model.safetensors").write_bytes(b"")
    (tmp_path / "notemplate" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    cases = {
        "missing": "no such file or folder",
        "notes.txt": "is a file but not a .gguf model",
        "empty": "not a usable model folder (no config.json)",
        "noweights": "not a usable model folder (no weights: no *.safetensors or *.bin file)",
        "notemplate": "not a usable model folder (no chat template: no chat_template.jinja, none in",
    }
    for name, problem in cases.items():
        with pytest.raises(ModelPathError) as info:
            check_model_path(tmp_path / name, "--model")
        msg = str(info.value)
        assert msg.startswith(f"--model = '{tmp_path / name}'") and problem in msg
        assert msg.endswith(f"expected {ACCEPTED}")


def test_gguf_without_its_packages_names_the_extra(tmp_path, monkeypatch):
    import runtime.model_import

    monkeypatch.setattr(runtime.model_import, "missing_packages", lambda: ["gguf"])
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelPathError, match=r"m\.gguf.*needs gguf: pip install -e '\.\[gguf\]'"):
        check_model_path(tmp_path / "m.gguf", "model.path", tmp_path / "models")


@pytest.mark.parametrize("command", ["eval", "train", "warmstart"])
def test_a_bad_model_path_is_one_line_in_each_command(tmp_path, capsys, command):
    bad = tmp_path / "weights.bin"
    bad.write_text("x")
    argv = [command, f"model.path={bad}", f"run.run_dir={tmp_path / 'run'}", "logging.progress=false"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"treeopsd {command}: model.path = '{bad}' is a file but not a .gguf model; expected {ACCEPTED}"
    ]
    assert not Path(tmp_path / "run").exists()


def test_model_import_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "taken").mkdir()
    cases = [
        (tmp_path / "nope.gguf", tmp_path / "out", "no such file; expected a .gguf model file"),
        (tmp_path / "notes.txt", tmp_path / "out", "not a .gguf model file"),
        (tmp_path / "m.gguf", tmp_path / "taken", "already exists; pick a new output folder"),
    ]
    for src, out, problem in cases:
        assert main(["model", "import", str(src), str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        where = out if "exists" in problem else src
        assert err == [f"treeopsd model import: {where}: {problem}"]
    assert not (tmp_path / "out").exists()
