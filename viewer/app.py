"""What the server and the export answer, over one run: the run's header, list pages and tree details.

view = RunView.open("runs/x", parse_call=fn)   # ViewError (one line) when the folder is not a run
view.run()                                     # name, method, notes, store state, who writes it
view.trees({"offset": "0", "no_signal": "1"})  # a list page (tree_index.TreeIndex.page)
view.tree("s0i0-000003")                       # one tree's JSON text (tree_detail.tree_detail)
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from viewer.run_files import RunFiles
from viewer.tree_detail import ParseCall, TokenText, tree_detail, tree_json
from viewer.tree_index import TreeIndex

PAGE_MAX = 500
FLAGS = ("no_signal", "truncated", "credited")


class RunView:
    def __init__(self, files: RunFiles, parse_call: ParseCall | None = None):
        self.files, self.parse_call = files, parse_call
        self.index = TreeIndex(files)
        self.text = TokenText(files.tokenizer_dir())

    @classmethod
    def open(cls, directory: str | Path, parse_call: ParseCall | None = None) -> RunView:
        return cls(RunFiles.open(directory), parse_call)

    def start(self) -> None:
        """The index's background thread, and the tokenizer loaded meanwhile (transformers imports slowly)."""
        self.index.start()
        threading.Thread(target=self.text.pieces, args=([],), name="view-tokenizer", daemon=True).start()

    def handlers(self) -> dict[str, Any]:
        return {"run": self.run, "trees": self.trees, "tree": self.tree}

    def run(self) -> dict[str, Any]:
        writer = self.files.writer()
        return {
            **self.files.summary(),
            "store": str(self.files.store),
            "store_problem": self.files.store_state(),
            "writer": None
            if writer is None
            else f"a running job ({writer}) is writing this store; new trees appear as they are committed",
        }

    def trees(self, params: dict[str, str]) -> dict[str, Any]:
        return self.index.page(**page_args(params))

    def tree(self, tree_id: str) -> str:
        return tree_json(tree_detail(self.index, tree_id, self.files.cfg, self.text, self.parse_call))

    def close(self) -> None:
        self.index.stop()


def _int(params: dict[str, str], key: str, default: int, lo: int, hi: int) -> int:
    try:
        value = int(params.get(key, default))
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {params[key]!r}") from None
    return min(max(value, lo), hi)


def page_args(params: dict[str, str]) -> dict[str, Any]:
    """Query parameters → TreeIndex.page arguments (ValueError: one line naming the parameter)."""
    filters: dict[str, Any] = {k: params.get(k) in ("1", "true", "on") for k in FLAGS}
    if params.get("mismatch_min"):
        try:
            filters["mismatch_min"] = float(params["mismatch_min"])
        except ValueError:
            raise ValueError(f"mismatch_min must be a number, got {params['mismatch_min']!r}") from None
    filters["q"] = params.get("q", "")
    return {
        "offset": _int(params, "offset", 0, 0, 1 << 31),
        "limit": _int(params, "limit", 50, 1, PAGE_MAX),
        "filters": filters,
        "sort": params.get("sort", "newest"),
        "descending": params.get("desc", "1") in ("1", "true"),
    }
