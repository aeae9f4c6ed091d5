"""Config validation: every malformed config is rejected before anything starts, naming the key."""

import pytest

from configs.schema import Config, ConfigError, load_config, parse_config, to_dict


def test_default_yaml_loads_and_derived_values():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.algo.method == "treeopsd" and (cfg.algo.M, cfg.algo.N) == (4, 2)
    assert cfg.algo.nominal_leaves == 12  # M(1+N) = 4·3
    assert cfg.algo.expected_cost == 8.0  # M(1+N/2) = 4·2, matched to G = 8
    assert cfg.store_dir == "runs/default/store"
    # round trip through plain data
    assert parse_config(to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.rho=0.5"], r"algo.rho = 0.5 is invalid: expected a number in the open interval \(0, 1/2\)"),
        (["algo.rho=0"], r"algo.rho = 0.0 is invalid"),
        (["algo.rho=-0.1"], r"algo.rho"),
        (["algo.M=0"], r"algo.M = 0 is invalid: expected an integer >= 1"),
        (["algo.M=2.5"], r"algo.M = 2.5 is invalid: expected an integer"),
        (["algo.colour=red"], r"unknown key algo.colour; allowed keys: G, M, N"),
        (["nonsense.key=1"], r"unknown key nonsense"),
        (["algo.teacher=softmax"], r"algo.teacher = 'softmax' is invalid: allowed values are 'odds', 'lo"),
        (["sampler.backend=tgi"], r"sampler.backend = 'tgi' is invalid: allowed values are 'hf', 'vllm'"),
        (["learner.lr=fast"], r"learner.lr = 'fast' is invalid: expected a number"),
        (["learner.packed_forward=1"], r"learner.packed_forward = 1 is invalid: expected true or false"),
        (["algo.grpo_clip=[0.2]"], r"algo.grpo_clip = \[0.2\] is invalid: expected a list of 2 values"),
        (["weights.bind_host=0.0.0.0"], r"weights.auth = 'none' is invalid: expected 'curve'"),
        (["store.eta=-1"], r"store.eta = -1 is invalid"),
        (["learner.minibatches=0"], r"learner.minibatches = 0"),
        (["algo=3"], r"algo must be a mapping"),
        (["badoverride"], r"must look like key.sub=value"),
    ],
)
def test_malformed_configs_are_rejected_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)


def test_overrides_parse_yaml_values():
    cfg = load_config(overrides=["algo.rho=0.25", "env.train_hops=[2,3]", "model.path=/x/y", "algo.N=0"])
    assert cfg.algo.rho == 0.25 and cfg.env.train_hops == (2, 3) and cfg.model.path == "/x/y"
    assert cfg.algo.expected_cost == 4.0  # M(1 + 0/2) = 4 : the flat (4,0) ablation
