"""BrowseComp-Plus in its local layout, and the search/open/answer deep-research env.

Files (docs/design.md §9.1):
- corpus JSONL ``{docid, text, url}``; ``text`` may start with a ``---\\ntitle: ...\\n---`` header, which is
  parsed off (title, date, ...) and not repeated in the body;
- queries JSONL (or a JSON list) ``{query_id, query, answer, evidence_docs?, gold_docs?, negative_docs?}``;
  in the published dataset every string except ``query_id`` is encrypted: base64 of the UTF-8 bytes XOR
  ``sha256(canary)`` repeated to the data's length (BrowseComp's scheme). Pass ``decrypt=True``;
- TREC qrels ``qid 0 docid rel``.
Official scoring is an LLM judge; here the reward is normalized EM against ``answer`` (F1 in info).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bm25s.stopwords import STOPWORDS_EN

from actors.envs.base import Task, Tool, ToolEnv, ToolError
from actors.envs.records import DatasetFormatError, Rec, iter_jsonl, read_records
from actors.envs.search import Bm25Index

DATASET = "browsecomp_plus"
SYSTEM_PROMPT = (
    "Research the question. Use search: <query> to find documents (each result is [docid] title: "
    "snippet), open: <docid> to read one, and answer: <answer> to give a short final answer."
)
_DOC_LISTS = ("evidence_docs", "gold_docs", "negative_docs")
_PLAIN_FIELDS = frozenset({"query_id", "canary"})  # never encrypted


# --- BrowseComp encryption -------------------------------------------------------------------------------


def derive_key(canary: str, length: int) -> bytes:
    """sha256(canary) repeated and cut to ``length`` bytes."""
    key = hashlib.sha256(canary.encode("utf-8")).digest()
    return key * (length // len(key)) + key[: length % len(key)]


def encrypt_string(plain: str, canary: str) -> str:
    data = plain.encode("utf-8")
    return base64.b64encode(
        bytes(a ^ b for a, b in zip(data, derive_key(canary, len(data)), strict=True))
    ).decode()


def decrypt_string(b64: str, canary: str) -> str:
    """Inverse of ``encrypt_string``; ValueError for bad base64 or bytes that are not UTF-8 (wrong canary)."""
    try:
        data = base64.b64decode(b64, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not base64: {exc}") from exc
    plain = bytes(a ^ b for a, b in zip(data, derive_key(canary, len(data)), strict=True))
    try:
        return plain.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError("decrypted bytes are not UTF-8 (wrong canary?)") from exc


def _decrypt_tree(value: Any, canary: str, label: str, rec: Rec) -> Any:
    """Decrypt every string in a JSON value (keys stay as they are)."""
    if isinstance(value, str):
        try:
            return decrypt_string(value, canary)
        except ValueError as exc:
            raise rec.error(f"cannot decrypt {label!r}: {exc}") from exc
    if isinstance(value, list):
        return [_decrypt_tree(v, canary, f"{label}[{i}]", rec) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _decrypt_tree(v, canary, f"{label}.{k}", rec) for k, v in value.items()}
    return value


# --- documents ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    docid: str
    title: str
    text: str  # body, header removed
    url: str = ""
    header: dict[str, str] = field(default_factory=dict, hash=False)


def parse_header(text: str) -> tuple[dict[str, str], str]:
    """Split a leading ``---`` ... ``---`` block of ``key: value`` lines off ``text``.
    Without a closing ``---`` the text is returned unchanged (it was not a header)."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != "---":
        return {}, text
    for end in range(1, len(lines)):
        if lines[end].strip() == "---":
            header = {}
            for line in lines[1:end]:
                key, sep, value = line.partition(":")
                if sep and key.strip():
                    header[key.strip().lower()] = value.strip().strip("\"'")
            return header, "\n".join(lines[end + 1 :]).lstrip("\n")
    return {}, text


def load_documents(path: str | Path) -> list[Document]:
    """The corpus JSONL; duplicate docids are an error."""
    docs: list[Document] = []
    seen: dict[str, str] = {}
    for rec in iter_jsonl(path):
        docid = str(rec.req("docid", (str, int)))
        if docid in seen:
            raise rec.error(f"duplicate docid {docid!r} (first at {seen[docid]})")
        seen[docid] = rec.where
        header, body = parse_header(rec.req("text", str))
        docs.append(Document(docid, header.get("title", ""), body, rec.opt("url", str, ""), header))
    if not docs:
        raise DatasetFormatError(path, "file", "no documents")
    return docs


# --- queries and qrels --------------------------------------------------------------------------------------


def _docids(rec: Rec, key: str) -> list[str]:
    out = []
    for i, item in enumerate(rec.opt(key, list, [])):
        if isinstance(item, (str, int)) and not isinstance(item, bool):
            out.append(str(item))
        else:
            out.append(str(rec.sub(f"{key}[{i}]", item).req("docid", (str, int))))
    return out


def load_queries(path: str | Path, decrypt: bool = False, canary: str | None = None) -> list[Task]:
    """Queries as tasks. With ``decrypt``, strings are decrypted with ``canary`` or, if None, with each
    record's own ``canary`` field."""
    tasks = []
    for rec in read_records(path):
        if decrypt:
            rec = Rec(decrypt_record(rec, canary), rec.path, rec.where)
        meta = {f"{key[:-5]}_docids": _docids(rec, key) for key in _DOC_LISTS}
        query_id = str(rec.req("query_id", (str, int)))
        tasks.append(Task(query_id, rec.req("query", str), (rec.req("answer", str),), DATASET, meta))
    return tasks


def decrypt_record(rec: Rec, canary: str | None = None) -> dict[str, Any]:
    """One query record with every string but `query_id`/`canary` decrypted (keys kept), by `canary` or,
    if None, the record's own `canary` field; errors name the file, the record and the field."""
    key = canary if canary is not None else rec.req("canary", str)
    return {k: v if k in _PLAIN_FIELDS else _decrypt_tree(v, key, k, rec) for k, v in rec.data.items()}


def decrypt_queries(path: str | Path, canary: str | None = None) -> list[dict[str, Any]]:
    """Every record of a queries file, decrypted (`treeopsd data decrypt-browsecomp`)."""
    return [decrypt_record(rec, canary) for rec in read_records(path)]


def load_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """TREC qrels ``qid 0 docid rel`` -> {qid: {docid: rel}}."""
    qrels: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            cols = line.split()
            if not cols:
                continue
            if len(cols) != 4 or not re.fullmatch(r"-?\d+", cols[3]):
                raise DatasetFormatError(
                    path, f"line {lineno}", f"expected 'qid 0 docid rel', got {line.strip()!r}"
                )
            qrels.setdefault(cols[0], {})[cols[2]] = int(cols[3])
    if not qrels:
        raise DatasetFormatError(path, "file", "no qrels")
    return qrels


# --- environment --------------------------------------------------------------------------------------------


def snippet(text: str, query: str, chars: int = 200) -> str:
    """About ``chars`` characters of ``text`` around the first query term it contains (else its start)."""
    flat = " ".join(text.split())
    low = flat.lower()
    terms = [t for t in re.findall(r"\w\w+", query.lower()) if t not in STOPWORDS_EN]
    hits = [p for p in (low.find(t) for t in terms) if p >= 0]
    start = max(0, min(hits) - chars // 4) if hits else 0
    if start > 0:  # begin on a word boundary
        space = flat.find(" ", start)
        start = space + 1 if 0 <= space < start + chars // 4 else start
    out = flat[start : start + chars]
    return ("…" if start > 0 else "") + out + ("…" if start + chars < len(flat) else "")


class DeepResearchEnv(ToolEnv):
    """search (snippets with docids and titles), open (document text within a character budget), answer."""

    name = "deep_research"

    def __init__(
        self,
        documents: Sequence[Document],
        topk: int = 5,
        snippet_chars: int = 200,
        open_chars: int = 5000,
        max_turns: int = 20,
        index: Bm25Index | None = None,
    ) -> None:
        self.docs = {d.docid: d for d in documents}
        if len(self.docs) != len(documents):
            raise ValueError("duplicate docids in documents")
        self.index = index or Bm25Index(
            [d.docid for d in documents], [f"{d.title}\n{d.text}" for d in documents]
        )
        self.topk, self.snippet_chars, self.open_chars = topk, snippet_chars, open_chars
        tools = [
            Tool(
                "search", "Search the web corpus; returns docids, titles and snippets.", "query", self.search
            ),
            Tool("open", "Read a document by its docid.", "docid", self.open),
        ]
        super().__init__(tools, SYSTEM_PROMPT, max_turns)

    def _title(self, doc: Document) -> str:
        return doc.title or doc.url or "(untitled)"

    def search(self, query: str) -> str:
        hits = self.index.search_one(query, self.topk)
        if not hits:
            return "no results"
        lines = []
        for hit in hits:
            doc = self.docs[hit["id"]]
            lines.append(f"[{doc.docid}] {self._title(doc)}: {snippet(doc.text, query, self.snippet_chars)}")
        return "\n".join(lines)

    def open(self, docid: str) -> str:
        doc = self.docs.get(docid.strip().strip("[]"))
        if doc is None:
            raise ToolError(f"unknown docid '{docid}'")
        body = doc.text[: self.open_chars]
        if len(doc.text) > self.open_chars:
            body += f"\n[truncated: {len(doc.text) - self.open_chars} more characters]"
        head = f"[{doc.docid}] {self._title(doc)}" + (f"\n{doc.url}" if doc.url else "")
        return f"{head}\n{body}"
