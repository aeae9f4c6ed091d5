"""`treeopsd store inspect DIR [--json]` and `treeopsd store verify DIR`.

inspect: trees per state, policy versions, leaves, tokens, segment and quarantine counts (read-only open:
problems are listed, nothing is moved). verify: exit 0 only if every committed segment decodes and every tree
in it passes validation; otherwise exit 1 with one line per bad file. Neither command takes the writer lock,
so both work on a store that a running job has open.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="store_command", required=True)
    inspect = sub.add_parser("inspect", help="summarize a replay store")
    inspect.add_argument("directory")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    verify = sub.add_parser("verify", help="check every committed tree; exit 1 naming the bad files")
    verify.add_argument("directory")


def _inspect(args: argparse.Namespace) -> int:
    from storage.replay_store import ReplayStore, StoreError

    try:
        store = ReplayStore(args.directory, create=False, readonly=True)
    except StoreError as e:
        print(f"treeopsd store inspect: {e}", file=sys.stderr)
        return 2
    with store:
        info = store.stats()
        info["problems"] = [f"{r['file']}: {r['reason']}" for r in store.recovery_report]
    if args.json:
        print(json.dumps(info, sort_keys=True))
        return 0
    t, seg = info["trees"], info["segments"]
    print(f"store {args.directory}")
    print(f"  trees      raw {t['raw']} (leased {t['leased']}), credited {t['credited']}, ", end="")
    print(f"consumed {t['consumed']}")
    print(f"  nodes {info['nodes']}, leaves {info['leaves']}, tokens {info['tokens']}, bytes {info['bytes']}")
    print(f"  versions   {info['policy_versions']} (turns per policy version)")
    print(f"  segments   {seg['total']} (raw {seg['raw']}, credited {seg['credited']}), ", end="")
    print(f"quarantined {info['quarantined']}")
    print(f"  batches    {info['batches_handed_out']} handed out")
    for line in info["problems"]:
        print(f"  problem    {line}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from storage.store_verify import verify_store

    result = verify_store(args.directory)
    for line in result.errors:
        print(f"ERROR {line}")
    for line in result.notes:
        print(f"note  {line}")
    if result.ok:
        trees = result.stats["trees"]["total"]
        print(f"ok: {trees} trees in {result.stats['segments']['total']} segments decode and validate")
    return 0 if result.ok else 1


def run(args: argparse.Namespace) -> int:
    return _inspect(args) if args.store_command == "inspect" else _verify(args)
