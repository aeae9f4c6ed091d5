"""`treeopsd view RUN_DIR`: a local web page over the run's rollout trees (viewer/, docs/viewer.md).

    treeopsd view runs/x                          # http://127.0.0.1:8765/ ; Ctrl-C stops it
    treeopsd view runs/x --port 0                 # any free port (the line printed names it)
    treeopsd view runs/x --host 0.0.0.0 --token T # elsewhere than loopback: a token is required
    treeopsd view runs/x --export DIR [--trees ID,ID | --first N --no-signal --truncated --sort spread]

Read-only over the run; works while it trains. Bad input is one line on stderr, exit 2: a folder that is
not a run, a port in use, a non-loopback host without a token, an export that would overwrite something.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

DEFAULT_PORT = 8765


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (config.yaml, store/) or a bare replay store")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any)"
    )
    parser.add_argument("--token", default=None, help="required off loopback (or $TREEOPSD_VIEW_TOKEN)")
    parser.add_argument("--export", metavar="DIR", default=None, help="write a static page folder instead")
    parser.add_argument("--trees", default="", help="--export: these tree ids (comma-separated)")
    parser.add_argument("--first", type=int, default=20, help="--export: else the first N of the list (20)")
    parser.add_argument("--no-signal", action="store_true", help="--export: only trees with no signal")
    parser.add_argument("--truncated", action="store_true", help="--export: only trees with a cut turn")
    parser.add_argument("--sort", default="newest", help="--export: newest, step, task, spread, size, ...")


def parse_call(text: str) -> dict[str, Any] | None:
    """The turn's tool call as the environments parse it (actors/envs/tool_calls.py)."""
    from actors.envs.tool_calls import ParseError, parse_tool_call

    call = parse_tool_call(text)
    if isinstance(call, ParseError):
        return {"error": call.reason} if call.attempted else None
    return {"name": call.name, "arguments": call.arguments}


def _export(args: argparse.Namespace, view: Any) -> int:
    from pathlib import Path

    from viewer.export import ExportError, choose, export

    ids = [t for t in args.trees.split(",") if t]
    filters = {"no_signal": args.no_signal, "truncated": args.truncated}
    try:
        rows = choose(view, ids, args.first, filters, args.sort)
        page = export(view, Path(args.export), rows)
    except (ExportError, ValueError) as e:
        print(f"treeopsd view: {e}", file=sys.stderr)
        return 2
    trees = f"{len(rows)} tree" + ("s" if len(rows) != 1 else "")
    print(f"treeopsd view: {trees} exported; open file://{page.resolve()}")
    return 0


def run(args: argparse.Namespace) -> int:
    from viewer.app import RunView
    from viewer.run_files import ViewError
    from viewer.server import ViewServer

    try:
        view = RunView.open(args.run_dir, parse_call=parse_call)
    except ViewError as e:
        print(f"treeopsd view: {e}", file=sys.stderr)
        return 2
    if args.export:
        return _export(args, view)
    try:
        server = ViewServer(view.handlers(), args.host, args.port, args.token)
    except (OSError, PermissionError) as e:
        hint = "; pass --port N (0: any free port)" if not isinstance(e, PermissionError) else ""
        print(f"treeopsd view: {e}{hint}", file=sys.stderr)
        return 2
    view.start()
    for line in filter(None, [view.files.store_state(), *view.files.notes]):
        print(f"treeopsd view: note: {line}", file=sys.stderr)
    if writer := view.files.writer():
        print(f"treeopsd view: note: a running job ({writer}) is writing this store", file=sys.stderr)
    print(f"treeopsd view: serving {view.files.root} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    finally:
        view.close()
    return 0


def view_command(run_dir: Any) -> str:
    """The line `train` and `demo` print: how to look at this run's trees."""
    from pathlib import Path

    return f"treeopsd view {Path(run_dir).resolve()}"
