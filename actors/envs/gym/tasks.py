"""Tasks of an outside environment: the rows of `env.data` as its ecosystem writes them, or the ecosystem's
own list (a verifiers taskset), as our general `Task`.

    rows = load_records("gsm8k.parquet")           # .jsonl/.ndjson: a record a line; .json: a list; .parquet
    task = task_from_record(rows[0], 0, "gym")     # Task(id, question, (), "gym", messages=…, record=row)

A row's prompt is its `prompt` (chat messages, or a string: one user message; SkyRL's dataset format); the
whole row rides along as `record`, for the environment (SkyRL's `extras`). Its id is its `id` (or
`task_id`), else a hash of the row: stable across runs and samplers, which key instances and
observations by it. A record the ecosystem gave (`{"id", "messages", "record"}`) is taken as it is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from actors.envs.base import Task
from actors.envs.gym.drivers import plain_messages, text_of

OWN_KEYS = {"id", "messages", "record"}


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a task file; a problem is one line naming the file (and the line)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"env.data = {str(path)!r}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return [dict(r) for r in pq.read_table(p).to_pylist()]
    text = p.read_text(encoding="utf-8")
    if p.suffix in (".jsonl", ".ndjson"):
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                rows.append(_json(line, f"env.data {p} line {n}"))
    else:
        rows = _json(text, f"env.data {p}")
        if not isinstance(rows, list):
            raise ValueError(f"env.data {p}: expected a JSON list of records (or a .jsonl file)")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"env.data {p}: record {bad + 1} is not a JSON object")
    if not rows:
        raise ValueError(f"env.data {p}: no records")
    return rows


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg} at char {exc.pos})") from None


def stable_id(record: Mapping[str, Any]) -> str:
    blob = json.dumps(record, sort_keys=True, default=str, ensure_ascii=False)
    return "t-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def task_from_record(record: Mapping[str, Any], index: int, dataset: str) -> Task:
    if set(record) >= OWN_KEYS and isinstance(record["record"], Mapping):
        task_id, messages, row = str(record["id"]), plain_messages(record["messages"]), dict(record["record"])
    else:
        row = dict(record)
        ident = row.get("id", row.get("task_id"))
        task_id = str(ident) if ident is not None else stable_id(row)
        messages = plain_messages(row.get("prompt"))
    users = [m["content"] for m in messages if m["role"] == "user"]
    question = text_of(users[-1]) if users else ""
    return Task(task_id, question, (), dataset, {"index": index}, messages=tuple(messages), record=row)
