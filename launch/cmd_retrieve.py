"""`treeopsd retrieve serve`: the shared retrieval service (Search-R1's `POST /retrieve`) over a corpus file.

    treeopsd retrieve serve --corpus wiki-18.jsonl --index bm25 [--index-dir DIR] [--host H] [--port P]
    treeopsd retrieve serve --corpus c.jsonl --index dense --encoder /models/all-MiniLM-L6-v2
    treeopsd retrieve serve --corpus c.jsonl --host 0.0.0.0 --token "$TOKEN"   # off loopback: a token

The port is bound first (a taken port fails at once), then the index is loaded, or built and saved when the
saved one is missing or stale (`actors/envs/retrieval_index.py` has the reuse rule), then one line says
where it serves: `treeopsd retrieve: serving N passages (bm25, loaded from DIR in 1.2 s) at URL`. Runs until
SIGINT/SIGTERM. Bad input (a missing corpus, an unusable index folder or encoder, a taken port, a public
address without a token) is one line naming the flag, exit 2.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys
from typing import Any

PROG = "treeopsd retrieve serve"


class UsageError(Exception):
    """One line for the user, naming the flag."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="retrieve_command", required=True)
    serve = sub.add_parser("serve", help="serve POST /retrieve over a corpus (Search-R1 contract)")
    serve.add_argument("--corpus", required=True, help="JSONL: {id, contents} (wiki-18) or {docid, text}")
    serve.add_argument("--index", choices=("bm25", "dense"), default="bm25")
    serve.add_argument("--index-dir", default=None, help="where the index is saved (default: <corpus>.index)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (not loopback: needs a token)")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port (the ready line says which)")
    serve.add_argument("--encoder", default=None, help="local sentence-transformers folder (dense)")
    serve.add_argument("--token", default=None, help="bearer token (default: $TREEOPSD_RETRIEVER_TOKEN)")


def _bind(args: argparse.Namespace) -> Any:
    from actors.envs.retrieval_server import RetrievalServer, resolve_token

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: expected a port number in [0, 65535]")
    try:
        return RetrievalServer(None, host=args.host, port=args.port, token=resolve_token(args.token))
    except PermissionError as exc:
        raise UsageError(f"--host {args.host}: {exc}") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"--port {args.port}: address already in use on {args.host}") from None
        if exc.errno == errno.EACCES:
            raise UsageError(f"--port {args.port}: permission denied on {args.host}") from None
        raise UsageError(
            f"--host {args.host}: cannot bind port {args.port} ({exc.strerror or exc})"
        ) from None


def _open(args: argparse.Namespace) -> Any:
    from actors.envs.dense import EncoderError
    from actors.envs.records import DatasetFormatError
    from actors.envs.retrieval_index import IndexDirError, default_index_dir, open_index

    if args.index == "dense" and not args.encoder:
        raise UsageError("--index dense needs --encoder PATH (a local sentence-transformers folder)")
    try:
        return open_index(args.corpus, args.index, args.index_dir, args.encoder)
    except FileNotFoundError:
        raise UsageError(f"--corpus {args.corpus}: no such file") from None
    except DatasetFormatError as exc:
        raise UsageError(f"--corpus {exc}") from None
    except EncoderError as exc:
        raise UsageError(f"--encoder {args.encoder}: {exc}") from None
    except IndexDirError as exc:
        where = args.index_dir or f"(default {default_index_dir(args.corpus)})"
        raise UsageError(f"--index-dir {where}: {exc}") from None
    except ImportError as exc:
        raise UsageError(
            f"--index {args.index}: {exc.name} is missing; pip install -e '.[retrieval]'"
        ) from None


def _serve(args: argparse.Namespace) -> int:
    server = _bind(args)
    try:
        opened = _open(args)
        server.index = opened.index
        how = f"loaded from {opened.directory}" if opened.reused else f"built and saved in {opened.directory}"
        print(
            f"treeopsd retrieve: serving {len(opened.index)} passages ({opened.kind}, {how} in "
            f"{opened.seconds:.1f} s) at {server.url}/retrieve",
            flush=True,
        )
        signal.signal(signal.SIGTERM, _exit)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _exit(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    try:
        return _serve(args)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
