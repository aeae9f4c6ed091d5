"""Bad input on the command line: one line on stderr naming the argument or the file, exit code 2, before
anything starts (no Ray, no model). Each row: argv, then a piece of text the message must contain."""

import pytest

from launch.cli import main

ROWS = [
    (["train", "--config", "{tmp}"], "config file {tmp} is a directory"),
    (["train", "--config", "{tmp}/none.yaml"], "config file {tmp}/none.yaml does not exist"),
    (["train", "algo.rho=x"], "algo.rho = 'x' is invalid"),
    (["train", "algo.M"], "override 'algo.M' must look like key.sub=value"),
    (["demo", "learner.minibatches=0"], "learner.minibatches = 0 is invalid"),
    (["config", "show", "--config", "{tmp}"], "config file {tmp} is a directory"),
    (["config", "show", "env.nope=1"], "env.nope"),
    (["eval", "--limit", "-1"], "argument --limit: expected an integer >= 1, got -1"),
    (["eval", "--limit", "x"], "argument --limit: expected an integer >= 1, got 'x'"),
    (["rollout", "--prompts", "0"], "argument --prompts: expected an integer >= 1, got 0"),
    (["export", "{tmp}/no-run", "{tmp}/out"], "run directory {tmp}/no-run does not exist"),
    (["report", "{tmp}/no-run"], "{tmp}/no-run does not exist"),
    (["report", "{run}", "--out", "{file}"], "--out {file} is a file"),
    (["bench", "learner", "--shape", "qwen9"], "--shape 'qwen9' is not one of"),
    (["bench", "learner", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["bench", "nosuch"], "argument name: invalid choice: 'nosuch'"),
    (["scale", "{tmp}/no-run", "--samplers", "2"], "{tmp}/no-run is not a treeopsd run directory"),
    (["scale", "{run}", "--samplers", "2"], "{run} is not running (its driver has exited)"),
    (
        ["store", "inspect", "{tmp}/no-store"],
        "{tmp}/no-store: no treeopsd replay store here (the directory does",
    ),
    (["eval", "--data", "{tmp}/q.jsonl", "env.name=multihop_qa"], "--data {tmp}/q.jsonl: no such file"),
    (["eval", "--data", "{tmp}/q.jsonl"], "--data {tmp}/q.jsonl: no such file"),  # not "needs env.name"
    (["model", "import", "{tmp}/m.gguf", "{tmp}/out"], "{tmp}/m.gguf: no such file"),
    (["train", "run.sampler_lag=2"], "run.sampler_lag = 2 is invalid: expected 0 for a run on Ray"),
    (["train", "algo.rollout_correction=geo_tis"], "algo.rollout_correction = 'geo_tis' is invalid"),
    (["train", "algo.mask_band=[2,3]"], "algo.mask_band = [2, 3] is invalid"),
    (
        ["train", "env.harness=nope.mod:fn", "env.protocol=qwen3"],
        "env.harness = 'nope.mod:fn': cannot import",
    ),
    (["train", "env.harness=examples.search_agent:run_episode"], "env.protocol = 'plain' is invalid"),
]


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's usage errors
        return int(e.code or 0)


@pytest.mark.parametrize(("argv", "wanted"), ROWS, ids=[" ".join(r[0][:3]) for r in ROWS])
def test_bad_input_is_one_line_and_exit_2(argv, wanted, tmp_path, capsys):
    run = tmp_path / "run"  # a stopped run: its config, logs, and the record of a driver long gone
    (run / "tb").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {}\n")
    (run / "ray-local.json").write_text('{"driver": [999999999, 1], "processes": []}')
    (tmp_path / "a-file").write_text("x")
    fill = {"tmp": str(tmp_path), "run": str(run), "file": str(tmp_path / "a-file")}
    argv = [a.format(**fill) for a in argv]
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert wanted.format(**fill) in err, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]  # argparse prints its usage first; the problem is the last line
    assert wanted.format(**fill) in last, err
