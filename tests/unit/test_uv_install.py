"""launch/uv_install.py: pip's settings (`pip config list`) become uv's flags and environment, so uv resolves
from the same indexes, wheel folders and constraints as pip would on this machine."""

from __future__ import annotations

import pytest

from launch.uv_install import main, read_pip_config, uv_arguments

# the shape of this machine's `pip config list`: files as `global.`, PIP_* variables as `:env:.`
LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/other.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/somewhere/else'
install.no-compile='true'
user.ignored='x'
not a setting
"""


def test_every_pip_setting_is_read_and_a_pip_variable_wins_over_a_file():
    settings = read_pip_config(LISTING)
    assert settings == {
        "cert": "/etc/ssl/certs/ca-certificates.crt",  # PIP_CERT over global.cert
        "default-timeout": "180",
        "find-links": "/opt/wheels",  # PIP_FIND_LINKS over global.find-links
        "constraint": "/etc/xdg/pip/constraints.txt",
        "extra-index-url": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
        "no-compile": "true",  # [install] is pip install's own section
    }


def test_the_variable_wins_in_either_order():
    reordered = "global.find-links='/file'\n:env:.find-links='/env'\nglobal.find-links='/file2'\n"
    assert read_pip_config(reordered) == {"find-links": "/env"}


def test_a_multi_line_value_becomes_one_flag_per_entry():
    settings = read_pip_config("global.extra-index-url='https://a/simple\\nhttps://b/simple'\n")
    args, _ = uv_arguments(settings)
    assert args == [
        "--index-strategy",
        "unsafe-best-match",
        "--extra-index-url",
        "https://a/simple",
        "--extra-index-url",
        "https://b/simple",
    ]


def test_settings_become_uv_flags_and_environment():
    settings = read_pip_config(LISTING) | {"index-url": "https://mirror/simple", "no-index": "yes"}
    args, env = uv_arguments(settings)
    assert args == [
        "--index-strategy",
        "unsafe-best-match",  # pip's rule: the best version over every index
        "--index-url",
        "https://mirror/simple",
        "--extra-index-url",
        "file:///opt/pypi/simple",
        "--extra-index-url",
        "file:///opt/pypi-more/simple",
        "--find-links",
        "/opt/wheels",
        "--constraint",
        "/etc/xdg/pip/constraints.txt",
        "--no-index",
    ]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}


def test_no_settings_leave_uv_at_its_defaults():
    assert uv_arguments({}) == (["--index-strategy", "unsafe-best-match"], {})


def test_main_runs_uv_with_the_settings_of_the_target_venvs_pip(tmp_path):
    """A fake target python answers `-m pip config list`; a fake uv records its arguments and environment."""
    target = tmp_path / "python"
    target.write_text("#!/bin/sh\nprintf \"global.find-links='/wheels'\\n:env:.cert='/c.crt'\\n\"\n")
    uv = tmp_path / "uv"
    uv.write_text(
        f'#!/bin/sh\necho "$@" > {tmp_path}/args\necho "$SSL_CERT_FILE" > {tmp_path}/cert\nexit 3\n'
    )
    target.chmod(0o755)
    uv.chmod(0o755)
    assert main([str(uv), str(target), "-e", ".[dev]"]) == 3  # uv's exit status is the script's
    want = f"pip install --quiet --python {target} --compile-bytecode --index-strategy unsafe-best-match"
    assert (tmp_path / "args").read_text().strip() == f"{want} --find-links /wheels -e .[dev]"
    assert (tmp_path / "cert").read_text().strip() == "/c.crt"


def test_main_without_its_arguments_prints_the_usage(capsys):
    assert main(["uv"]) == 2
    assert capsys.readouterr().err.startswith("usage: python launch/uv_install.py UV TARGET_PYTHON")


@pytest.mark.parametrize("line", ["=x", "global.=x", "nosection='x'"])
def test_malformed_lines_are_skipped(line):
    assert read_pip_config(line) == {}
