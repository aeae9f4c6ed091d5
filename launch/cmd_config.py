"""`treeopsd config show [--config FILE] [key=value ...]`: the resolved config as YAML, every key with its
value after the file and the overrides (the embedded default without --config), checked by the schema as
`train` would check it, so a run's configuration can be read before it starts."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("show",), help="show: print the resolved config")
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("overrides", nargs="*", help="config overrides key.sub=value")


def run(args: argparse.Namespace) -> int:
    import yaml

    from configs.schema import ConfigError, load_config, to_dict

    try:
        cfg = load_config(args.config, list(args.overrides))
    except ConfigError as e:
        print(f"treeopsd config: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0
