"""`treeopsd config show`: the resolved config as YAML, equal to what `train` would run with; bad input is
one line naming the key or the file, exit code 2."""

import yaml

from configs.schema import load_config, to_dict
from launch.cli import main


def test_show_prints_the_resolved_config(capsys):
    assert main(["config", "show", "env.max_turns=9", "algo.rho=0.2"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == to_dict(load_config(None, ["env.max_turns=9", "algo.rho=0.2"]))
    assert shown["env"]["max_turns"] == 9 and shown["algo"]["rho"] == 0.2


def test_bad_input_is_one_line(capsys, tmp_path):
    cases = [
        (["algo.rho=x"], "algo.rho = 'x' is invalid"),
        (["--config", str(tmp_path)], f"config file {tmp_path} is a directory"),
        (["--config", str(tmp_path / "none.yaml")], f"config file {tmp_path / 'none.yaml'} does not exist"),
    ]
    for extra, message in cases:
        assert main(["config", "show", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"treeopsd config: {message}") and err.count("\n") == 1, err
