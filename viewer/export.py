"""`treeopsd view RUN_DIR --export DIR`: the page and the data of chosen trees in a folder that opens
without a server (file://DIR/index.html), for a bug report or a paper figure.

    DIR/index.html          the server's page, with one more script tag: static/data.js
    DIR/static/             view.js, tree.js, view.css (the same files) and data.js:
                            window.TREEOPSD_EXPORT = {run, rows, trees: {id: detail}, exported_at}
    DIR/export.json         what was exported: the run, the tree ids, the command's choice

The data is a script, not a JSON file beside the page, because a page opened from file:// may not fetch.
DIR must be new, empty, or an earlier export (export.json): nothing else is overwritten.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from storage.durable import write_atomic
from viewer.app import RunView
from viewer.server import STATIC, STATIC_FILES
from viewer.tree_detail import tree_detail

MARKER = "export.json"


class ExportError(RuntimeError):
    """An export that would overwrite something or has nothing to export; the message is one line."""


def choose(view: RunView, ids: list[str], first: int, filters: dict[str, Any], sort: str) -> list[dict]:
    """The rows to export: the named trees, else the first `first` of the list under the filters."""
    view.index.index_all()
    if ids:
        rows = [view.index.row(t) for t in ids]
        missing = [t for t, r in zip(ids, rows, strict=True) if r is None]
        if missing:
            raise ExportError(
                f"no tree {missing[0]!r} in {view.files.store} ({len(missing)} of the named trees)"
            )
        return [r for r in rows if r is not None]
    rows = view.index.page(0, first, filters, sort, wait_s=0.0)["rows"]
    if not rows:
        raise ExportError(f"no tree of {view.files.store} matches the filters")
    return rows


def _check_target(out: Path, store: Path) -> None:
    if out.resolve().is_relative_to(store.resolve()):
        raise ExportError(f"{out}: inside the replay store {store}; the viewer never writes there")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise ExportError(f"{out}: exists and is not an empty folder or an earlier export; pick a new folder")


def export(view: RunView, out: Path, rows: list[dict]) -> Path:
    """Writes the folder; returns its index.html."""
    _check_target(out, view.files.store)
    trees = {
        r["id"]: tree_detail(view.index, r["id"], view.files.cfg, view.text, view.parse_call) for r in rows
    }
    data = {
        "run": view.run(),
        "rows": rows,
        "trees": trees,
        "exported_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / "static").mkdir(parents=True, exist_ok=True)
    for name in STATIC_FILES - {"index.html"}:
        shutil.copyfile(STATIC / name, out / "static" / name)
    script = "window.TREEOPSD_EXPORT = " + json.dumps(data, allow_nan=False, separators=(",", ":")) + ";\n"
    write_atomic(out / "static" / "data.js", script.encode())
    page = (STATIC / "index.html").read_text()
    page = page.replace("<!--export-data-->", '<script src="static/data.js"></script>')
    write_atomic(out / "index.html", page.encode())
    info = {"run_dir": str(view.files.root.resolve()), "trees": list(trees)}
    write_atomic(out / MARKER, json.dumps(info, indent=1).encode())
    return out / "index.html"
