"""Fuzzed configuration (configs/schema.py: load_config, parse_config, apply_overrides): random YAML files
and random `key=value` overrides give a Config or one ConfigError line that names a key (the dotted key of
the input or of the schema it broke), never another exception, never a traceback.

2,000 derandomized cases each: YAML files (valid and broken), override lists. Pure, no Ray: seconds.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from configs.schema import Config, ConfigError, apply_overrides, load_config, parse_config


def schema_keys(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, type[BaseModel] | None]:
    """Every dotted key of the schema -> its section model (None for a leaf field)."""
    out: dict[str, type[BaseModel] | None] = {}
    for name, info in model.model_fields.items():
        key, sub = prefix + name, info.annotation
        section = sub if isinstance(sub, type) and issubclass(sub, BaseModel) else None
        out[key] = section
        if section is not None:
            out.update(schema_keys(section, key + "."))
    return out


KEYS = schema_keys()
DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
DEFAULT_DATA = yaml.safe_load(DEFAULT.read_text())  # parsed once: what load_config(overrides=...) starts from
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
SECTIONS = [k for k, v in KEYS.items() if v is not None]
LEAVES = [k for k, v in KEYS.items() if v is None]
# the shapes the errors take: `key = value is invalid: ...`, `unknown key k; ...`, `key must be a mapping`
UNKNOWN = re.compile(r"^unknown key (?P<key>.+?); allowed keys: ")
NAMED = re.compile(r"^(?P<key>[^ ]+) (= .* is invalid: |must be a mapping, got |is invalid: )")

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["1e-3", "0.0.0.0", "127.0.0.1", "hf", "vllm", "sync", "[2, 3]", "2020-01-01", ""]),
)
# one level of nesting: a list or a mapping where a scalar belongs (and the reverse) is every type error the
# schema can meet; st.recursive would cost more to draw than the case costs to run
values = st.one_of(
    scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=6), scalars, max_size=3)
)
# keys as config files spell them (no whitespace), odd characters included
odd_names = st.text(
    st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp")), min_size=1, max_size=10
)
key_names = st.one_of(st.sampled_from(LEAVES + SECTIONS), odd_names)


@st.composite
def config_data(draw) -> dict[str, Any]:
    """Plain data shaped like a config: known and unknown dotted keys set to random values."""
    data: dict[str, Any] = {}
    for key in draw(st.lists(key_names, max_size=5)):
        node, parts = data, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[parts[-1]] = draw(values)
    return data


def yaml_text() -> st.SearchStrategy[str]:
    broken = st.sampled_from(
        ["algo: [unclosed\n", "a: b: c\n", "- 1\n- 2\n", "!!binary abc\n", "{a", ": :", "\t- x"]
    )
    # libyaml's dumper (C) only writes the inputs, quicker; they are read as load_config reads them
    dumped = config_data().map(lambda d: yaml.dump(d, Dumper=DUMPER, allow_unicode=True))
    return st.one_of(
        dumped, broken, st.text(max_size=40), st.lists(st.one_of(dumped, broken), max_size=3).map("".join)
    )


def overrides() -> st.SearchStrategy[list[str]]:
    raw_value = st.one_of(
        st.text(max_size=12),
        st.sampled_from(["[", "{a: ", "!!binary abc", "!!python/object:os.system x", "[2,3]"]),
    )
    value = st.one_of(
        values.map(lambda v: yaml.dump(v, Dumper=DUMPER, default_flow_style=True).strip()), raw_value
    )
    key = st.one_of(
        key_names, st.sampled_from(["", ".", "algo.", "algo..M", "algo.M.x", ".algo.M", "run.name.x"])
    )
    item = st.one_of(st.tuples(key, value).map("=".join), st.text(max_size=16))
    return st.lists(item, max_size=4)


def key_paths(data: Any, prefix: str = "") -> set[str]:
    """Every dotted key path of plain data (keys as the error messages print them)."""
    if not isinstance(data, dict):
        return set()
    out = set()
    for k, v in data.items():
        path = prefix + str(k)
        out |= {path} | key_paths(v, path + ".")
    return out


def assert_names_a_key(message: str, data: Any) -> None:
    """One line naming a key: one the input holds (unknown) or one of the schema (a bad value, a rule)."""
    assert "\n" not in message and message.strip() == message, message
    if m := UNKNOWN.match(message):
        named = {m["key"]}  # as given, or quoted (repr) when empty, unprintable or with a space
        with contextlib.suppress(ValueError, SyntaxError):
            named.add(str(ast.literal_eval(m["key"])))
        assert named & key_paths(data), message
        return
    m = NAMED.match(message)
    assert m is not None, message
    key, parts = m["key"], m["key"].split(".")
    leaf = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in KEYS), None)
    # a schema key, or a key inside a field whose value is a mapping of its own (sampler.engine)
    assert key == "config" or key == leaf or (leaf in LEAVES and key in key_paths(data)), message


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="treeopsd-fuzz-", dir=shm or tmp_path_factory.getbasetemp()))


@settings(max_examples=2000, deadline=None)
@given(yaml_text())
def test_a_random_yaml_file_is_a_config_or_one_config_error(scratch, text):
    path = scratch / "config.yaml"
    path.write_text(text)
    try:
        cfg = load_config(path)
    except ConfigError as e:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            assert f"config file {path} is not valid YAML" in str(e)
            return
        if not isinstance(data, dict | None):
            assert str(e) == f"config file {path} must hold a mapping at the top level"
            return
        assert_names_a_key(str(e), data)
    else:
        assert isinstance(cfg, Config) and parse_config(cfg.model_dump(mode="json")) == cfg


@settings(max_examples=2000, deadline=None)
@given(overrides())
def test_random_overrides_are_a_config_or_one_config_error_naming_the_key(items):
    try:
        cfg = parse_config(DEFAULT_DATA, items)  # = load_config(overrides=items), without re-reading the file
    except ConfigError as e:
        message = str(e)
        if message.startswith("override "):  # the override itself is malformed: it is quoted
            assert "\n" not in message, message
            assert any(repr(i) in message or i.partition("=")[0].strip() in message for i in items), message
            return
        assert_names_a_key(message, apply_overrides(copy.deepcopy(DEFAULT_DATA), items))
    else:
        assert isinstance(cfg, Config) and parse_config(cfg.model_dump(mode="json")) == cfg


def test_the_strategies_reach_every_kind_of_outcome():
    assert math.isclose(load_config(overrides=["algo.rho=1e-1"]).algo.rho, 0.1)
    assert load_config(overrides=["run.seed=3"]) == parse_config(DEFAULT_DATA, ["run.seed=3"])  # same path
    assert yaml.safe_load(DEFAULT.read_text()) == DEFAULT_DATA  # the fuzz cases changed no shared data
    with pytest.raises(ConfigError, match=r"^override 'algo.rho=\[': the value is not valid YAML \(while"):
        load_config(overrides=["algo.rho=["])
    with pytest.raises(ConfigError, match=r"^override '=1' must look like key.sub=value"):
        load_config(overrides=["=1"])
    with pytest.raises(ConfigError, match=r"^override 'algo..M=1' must look like key.sub=value"):
        load_config(overrides=["algo..M=1"])
    with pytest.raises(ConfigError, match=r"^override 'run.seed=2020-02-30': the value is not valid YAML"):
        load_config(overrides=["run.seed=2020-02-30"])  # PyYAML raises a ValueError for this date
    with pytest.raises(ConfigError, match=r"^unknown key ''; allowed keys: algo, env,"):
        parse_config({"": 1})
    with pytest.raises(ConfigError, match=r"^unknown key 'algo.a b'; allowed keys: G, M, N,"):
        parse_config({"algo": {"a b": 1}})
