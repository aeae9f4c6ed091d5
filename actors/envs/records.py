"""Reading local dataset files record by record, with errors that name the file and the record.

Nothing here skips a bad record: every problem raises ``DatasetFormatError`` (a ``ValueError``) whose
message reads ``<file>: <record>: <problem>``, e.g. ``dev.jsonl: line 3: missing key 'question'``.
Blank JSONL lines are not records and are ignored.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DatasetFormatError(ValueError):
    """A local dataset file does not match the expected format."""

    def __init__(self, path: str | Path, where: str, problem: str) -> None:
        self.path, self.where, self.problem = str(path), where, problem
        super().__init__(f"{path}: {where}: {problem}")


@dataclass(frozen=True)
class Rec:
    """One raw record plus where it came from, with typed getters that raise naming both."""

    data: dict[str, Any]
    path: str
    where: str  # "line 3", "index 2", "row 4"

    def error(self, problem: str) -> DatasetFormatError:
        return DatasetFormatError(self.path, self.where, problem)

    def req(self, key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in self.data:
            raise self.error(f"missing key {key!r}")
        return self._check(key, self.data[key], kind)

    def opt(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else self._check(key, value, kind)

    def req_str_list(self, key: str) -> list[str]:
        values = self.req(key, list)
        return [self.check_str(f"{key}[{i}]", v) for i, v in enumerate(values)]

    def check_str(self, label: str, value: Any) -> str:
        return self._check(label, value, str)

    def sub(self, label: str, value: Any) -> Rec:
        """A nested object as its own record, located as ``line 3, paragraphs[2]``."""
        self._check(label, value, dict)
        return Rec(value, self.path, f"{self.where}, {label}")

    def _check(self, label: str, value: Any, kind: type | tuple[type, ...]) -> Any:
        # bool is an int subclass; a JSON true where an int is expected is still a format error
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            want = " or ".join(k.__name__ for k in _as_tuple(kind))
            raise self.error(f"key {label!r} should be {want}, got {type(value).__name__}")
        return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _open_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetFormatError(path, f"byte {exc.start}", "file is not UTF-8") from exc


def iter_jsonl(path: str | Path) -> Iterator[Rec]:
    """Yield one record per non-blank line; each must be a JSON object."""
    p = Path(path)
    with open(p, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetFormatError(p, where, f"bad JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(obj, dict):
                raise DatasetFormatError(p, where, f"expected a JSON object, got {type(obj).__name__}")
            yield Rec(obj, str(p), where)


def read_json_records(path: str | Path) -> list[Rec]:
    """A JSON file holding a list of objects, or a column-wise dict of equal-length lists (HF to_dict)."""
    p = Path(path)
    try:
        obj = json.loads(_open_text(p))
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise DatasetFormatError(p, where, f"bad JSON ({exc.msg}); truncated file?") from exc
    if isinstance(obj, dict):
        obj = _columns_to_rows(p, obj)
    if not isinstance(obj, list):
        raise DatasetFormatError(p, "top level", f"expected a JSON list of records, got {type(obj).__name__}")
    recs = []
    for i, item in enumerate(obj):
        if not isinstance(item, dict):
            raise DatasetFormatError(p, f"index {i}", f"expected a JSON object, got {type(item).__name__}")
        recs.append(Rec(item, str(p), f"index {i}"))
    return recs


def _columns_to_rows(path: Path, cols: dict[str, Any]) -> list[dict[str, Any]]:
    bad = [k for k, v in cols.items() if not isinstance(v, list)]
    if bad or not cols:
        raise DatasetFormatError(path, "top level", f"a JSON object must map columns to lists (bad: {bad})")
    lengths = {k: len(v) for k, v in cols.items()}
    if len(set(lengths.values())) != 1:
        raise DatasetFormatError(path, "top level", f"columns have different lengths: {lengths}")
    n = next(iter(lengths.values()))
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def read_records(path: str | Path) -> list[Rec]:
    """JSONL for ``.jsonl``/``.ndjson`` files, else a JSON list (or column dict)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file not found: {p}")
    recs = list(iter_jsonl(p)) if p.suffix.lower() in (".jsonl", ".ndjson") else read_json_records(p)
    if not recs:
        raise DatasetFormatError(p, "file", "no records")
    return recs


def read_csv_records(path: str | Path, required: tuple[str, ...]) -> list[Rec]:
    """CSV with a header row; ``where`` is the 1-based file line of the row."""
    p = Path(path)
    with open(p, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        missing = [c for c in required if c not in header]
        if missing:
            raise DatasetFormatError(p, "line 1 (header)", f"missing column(s) {missing}; found {header}")
        recs = []
        for row in reader:
            where = f"line {reader.line_num}"
            if None in row or any(row[c] is None for c in required):
                raise DatasetFormatError(p, where, "wrong number of fields")
            recs.append(Rec(dict(row), str(p), where))
    if not recs:
        raise DatasetFormatError(p, "file", "no rows after the header")
    return recs
