"""Installs packages into a venv with uv, under the settings this machine gives pip.

uv reads none of pip's configuration, so a machine whose packages come from a mirror, a folder of wheels
(`find-links`: here the torch CPU wheel), a constraints file or a private certificate would resolve other
packages, or none, with a bare `uv pip install`. This reads `pip config list` (files and PIP_* variables
alike) and passes the settings on. `--index-strategy unsafe-best-match` keeps pip's rule of taking the best
version across every index. Used by launch/setup_venv.sh (USAGE below).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

# `pip config list` names a setting `section.key`; PIP_* variables show as `:env:.key` and override files
SECTIONS = ("global", "install", ":env:")
USAGE = "python launch/uv_install.py UV TARGET_PYTHON [pip install arguments...]"
MULTI = {"extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint"}


def read_pip_config(listing: str) -> dict[str, str]:
    """The settings for `pip install` from `pip config list` lines (`global.find-links='/opt/wheels'`,
    `:env:.cert='...'`); a PIP_* variable wins over a file."""
    found: dict[str, tuple[bool, str]] = {}
    for line in listing.splitlines():
        name, sep, quoted = line.partition("=")
        section, _, key = name.rpartition(".")
        if not sep or not key or section not in SECTIONS:
            continue
        from_env = section == ":env:"
        if key not in found or from_env or not found[key][0]:
            found[key] = (from_env, " ".join(shlex.split(quoted.replace("\\n", " "))))  # repr'd lines
    return {key: value for key, (_, value) in found.items()}


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's flags and environment for pip's settings."""
    args = ["--index-strategy", "unsafe-best-match"]
    env: dict[str, str] = {}
    if "index-url" in settings:
        args += ["--index-url", settings["index-url"]]
    for key, flag in MULTI.items():
        for value in settings.get(key, "").split():
            args += [flag, value]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if "cert" in settings:
        env["SSL_CERT_FILE"] = settings["cert"]
    timeout = settings.get("default-timeout") or settings.get("timeout")
    if timeout:
        env["UV_HTTP_TIMEOUT"] = timeout
    return args, env


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    uv, target, rest = argv[0], argv[1], argv[2:]
    listing = subprocess.run(
        [target, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    args, env = uv_arguments(read_pip_config(listing))
    cmd = [uv, "pip", "install", "--quiet", "--python", target, "--compile-bytecode", *args, *rest]
    return subprocess.run(cmd, env={**os.environ, **env}, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
