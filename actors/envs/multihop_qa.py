"""Loaders for the paper's multi-hop QA sets in their exact local formats, and the search env over them.

Formats (docs/design.md §9.1); ``load_dataset(path)`` detects them from the first record:
- ``hotpotqa``: official JSON list (``_id``, ``context: [[title, [sent]]]``, ``supporting_facts: [[title,
  i]]``) or the HF layout (``id``, column-wise ``context``/``supporting_facts``), as a JSON list, a JSON
  dict of columns, or JSONL. Both layouts give identical tasks.
- ``2wikimultihopqa``: HotpotQA's official layout plus ``evidences`` and ``entity_ids``.
- ``musique``: JSONL with ``paragraphs``, ``question_decomposition``, ``answer`` and ``answer_aliases``.
- ``bamboogle``: CSV with ``Question``, ``Answer`` columns, or JSON/JSONL rows with the same keys.
- ``flashrag``: Search-R1/FlashRAG JSONL ``{id, question, golden_answers: [str], metadata}``.
- ``wiki18``: corpus JSONL ``{id, contents: "\\"Title\\"\\ntext"}`` (passages only, no tasks).
Paragraphs shipped with the questions become the corpus, de-duplicated by (title, text).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.envs.base import Task, Tool, ToolEnv
from actors.envs.records import DatasetFormatError, Rec, read_csv_records, read_records
from actors.envs.search import Bm25Index, Passage, Retriever

FORMATS = ("hotpotqa", "2wikimultihopqa", "musique", "bamboogle", "flashrag", "wiki18")
_ALIASES = {"hotpot": "hotpotqa", "hotpot_qa": "hotpotqa", "2wiki": "2wikimultihopqa", "wiki-18": "wiki18"}
SYSTEM_PROMPT = (
    "Answer the question. Use search: <query> to search Wikipedia (it returns passages) as often as you "
    "need, then answer: <answer> with a short answer."
)


@dataclass
class QADataset:
    name: str
    tasks: list[Task] = field(default_factory=list)
    passages: list[Passage] = field(default_factory=list)


class _Corpus:
    """Collects paragraphs; ids are the title, then ``title#2``, ... for other texts under one title."""

    def __init__(self) -> None:
        self.passages: list[Passage] = []
        self._ids: dict[tuple[str, str], str] = {}
        self._per_title: dict[str, int] = {}

    def add(self, title: str, text: str) -> str:
        key = (title, text)
        if key not in self._ids:
            n = self._per_title.get(title, 0) + 1
            self._per_title[title] = n
            self._ids[key] = title if n == 1 else f"{title}#{n}"
            self.passages.append(Passage(self._ids[key], title, text))
        return self._ids[key]


def parse_contents(contents: str) -> tuple[str, str]:
    """Split wiki-18 ``contents`` into (title, text); the title is the first line, in quotes."""
    first, _, rest = contents.partition("\n")
    if len(first) >= 2 and first.startswith('"') and first.endswith('"'):
        return first[1:-1], rest
    return "", contents


def _join(sentences: list[str]) -> str:
    return " ".join(s.strip() for s in sentences if s.strip())


def _id_of(rec: Rec) -> str:
    for key in ("_id", "id"):
        if key in rec.data:
            value = rec.req(key, (str, int))
            return str(value)
    raise rec.error("missing key '_id' (or 'id')")


def _hotpot_context(rec: Rec) -> list[tuple[str, list[str]]]:
    ctx = rec.req("context", (list, dict))
    if isinstance(ctx, dict):  # HF: {"title": [t], "sentences": [[s]]}
        sub = rec.sub("context", ctx)
        titles, sents = sub.req_str_list("title"), sub.req("sentences", list)
        if len(titles) != len(sents):
            raise rec.error(f"context has {len(titles)} titles but {len(sents)} sentence lists")
        pairs: list[Any] = list(zip(titles, sents, strict=True))
    else:
        pairs = ctx
    out = []
    for i, pair in enumerate(pairs):
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)
        ok = ok and isinstance(pair[1], list) and all(isinstance(s, str) for s in pair[1])
        if not ok:
            raise rec.error(f"context[{i}] should be [title: str, sentences: list[str]]")
        out.append((pair[0], list(pair[1])))
    return out


def _hotpot_facts(rec: Rec) -> list[list[Any]]:
    facts = rec.opt("supporting_facts", (list, dict), [])
    if isinstance(facts, dict):  # HF: {"title": [t], "sent_id": [i]}
        sub = rec.sub("supporting_facts", facts)
        titles, ids = sub.req_str_list("title"), sub.req("sent_id", list)
        if len(titles) != len(ids):
            raise rec.error("supporting_facts columns 'title' and 'sent_id' differ in length")
        facts = [list(p) for p in zip(titles, ids, strict=True)]
    for i, fact in enumerate(facts):
        ok = isinstance(fact, (list, tuple)) and len(fact) == 2 and isinstance(fact[0], str)
        if not ok or not isinstance(fact[1], int) or isinstance(fact[1], bool):
            raise rec.error(f"supporting_facts[{i}] should be [title: str, sent_id: int]")
    return [[t, i] for t, i in facts]


def _hotpot_task(rec: Rec, corpus: _Corpus, dataset: str) -> Task:
    """A HotpotQA (either layout) or 2WikiMultiHopQA record; the answer is absent in test files."""
    task_id, question = _id_of(rec), rec.req("question", str)
    answer = rec.opt("answer", str)
    context = _hotpot_context(rec)
    meta: dict[str, Any] = {
        "type": rec.opt("type", str),
        "level": rec.opt("level", str),
        "supporting_facts": _hotpot_facts(rec),
        "context_ids": [corpus.add(title, _join(sents)) for title, sents in context],
    }
    if dataset == "2wikimultihopqa":
        evidences = rec.opt("evidences", list, [])
        for i, ev in enumerate(evidences):
            if not (isinstance(ev, list) and len(ev) == 3 and all(isinstance(x, str) for x in ev)):
                raise rec.error(f"evidences[{i}] should be [subject, relation, object] strings")
        meta["evidences"] = evidences
        meta["entity_ids"] = rec.opt("entity_ids", str)
    return Task(task_id, question, (answer,) if answer is not None else (), dataset, meta)


def _musique_task(rec: Rec, corpus: _Corpus, dataset: str) -> Task:
    task_id, question = _id_of(rec), rec.req("question", str)
    answer = rec.opt("answer", str)  # absent in the test files
    aliases = rec.req_str_list("answer_aliases") if "answer_aliases" in rec.data else []
    answers = list(dict.fromkeys(a for a in [answer, *aliases] if a is not None))
    paragraph_ids, supporting = [], []
    for i, raw in enumerate(rec.req("paragraphs", list)):
        para = rec.sub(f"paragraphs[{i}]", raw)
        pid = corpus.add(para.req("title", str), para.req("paragraph_text", str))
        paragraph_ids.append(pid)
        if para.opt("is_supporting", bool, False):
            supporting.append(pid)
    decomposition = []
    for i, raw in enumerate(rec.opt("question_decomposition", list, [])):
        step = rec.sub(f"question_decomposition[{i}]", raw)
        decomposition.append(
            {
                "id": step.req("id", int),
                "question": step.req("question", str),
                "answer": step.req("answer", str),
                "paragraph_support_idx": step.opt("paragraph_support_idx", int),
            }
        )
    hops = re.match(r"(\d)hop", task_id)
    meta = {
        "hops": int(hops.group(1)) if hops else None,
        "answerable": rec.opt("answerable", bool, True),
        "decomposition": decomposition,
        "context_ids": paragraph_ids,
        "supporting_ids": supporting,
    }
    return Task(task_id, question, tuple(answers), dataset, meta)


def _bamboogle_task(rec: Rec, index: int, dataset: str) -> Task:
    question, answer = rec.req("Question", str).strip(), rec.req("Answer", str).strip()
    if not question or not answer:
        raise rec.error("empty 'Question' or 'Answer'")
    return Task(f"{dataset}-{index}", question, (answer,), dataset, {})


def _flashrag_task(rec: Rec, dataset: str) -> Task:
    answers = rec.req_str_list("golden_answers")
    meta = rec.opt("metadata", dict, {})
    return Task(_id_of(rec), rec.req("question", str), tuple(answers), dataset, dict(meta))


def _wiki18_passage(rec: Rec) -> Passage:
    doc_id = str(rec.req("id", (str, int)))
    title, text = parse_contents(rec.req("contents", str))
    return Passage(doc_id, title, text)


def detect_format(path: str | Path, first: dict[str, Any] | None = None) -> str:
    p = Path(path)
    if p.suffix.lower() == ".csv":
        return "bamboogle"
    keys = set(first or {})
    checks = [
        ("contents", "wiki18"),
        ("golden_answers", "flashrag"),
        ("paragraphs", "musique"),
        ("evidences", "2wikimultihopqa"),
        ("entity_ids", "2wikimultihopqa"),
        ("context", "hotpotqa"),
        ("Question", "bamboogle"),
    ]
    for key, fmt in checks:
        if key in keys:
            return fmt
    raise DatasetFormatError(
        p, "first record", f"cannot detect the format from keys {sorted(keys)}; pass fmt="
    )


def load_dataset(path: str | Path, fmt: str = "auto", dataset: str | None = None) -> QADataset:
    """Read one local file. ``fmt`` is "auto" or one of FORMATS; ``dataset`` names the tasks' dataset
    (default: the format, or for flashrag the parent folder, as in ``<dataset>/test.jsonl``)."""
    p = Path(path)
    fmt = _ALIASES.get(fmt, fmt)
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use 'auto' or one of {FORMATS}")
    if fmt == "bamboogle" or (fmt == "auto" and p.suffix.lower() == ".csv"):
        recs = read_csv_records(p, ("Question", "Answer")) if p.suffix.lower() == ".csv" else read_records(p)
    else:
        recs = read_records(p)
    if fmt == "auto":
        fmt = detect_format(p, recs[0].data)
    name = dataset or (p.parent.name if fmt == "flashrag" and p.parent.name else fmt)
    corpus = _Corpus()
    builders: dict[str, Callable[[int, Rec], Task]] = {
        "hotpotqa": lambda i, r: _hotpot_task(r, corpus, name),
        "2wikimultihopqa": lambda i, r: _hotpot_task(r, corpus, name),
        "musique": lambda i, r: _musique_task(r, corpus, name),
        "bamboogle": lambda i, r: _bamboogle_task(r, i, name),
        "flashrag": lambda i, r: _flashrag_task(r, name),
    }
    if fmt == "wiki18":
        return QADataset(name, [], _unique_ids(p, [_wiki18_passage(r) for r in recs]))
    tasks = [builders[fmt](i, r) for i, r in enumerate(recs)]
    return QADataset(name, tasks, corpus.passages)


def load_corpus(path: str | Path) -> list[Passage]:
    """A wiki-18 style corpus JSONL."""
    return load_dataset(path, "wiki18").passages


def _unique_ids(path: Path, passages: list[Passage]) -> list[Passage]:
    seen: dict[str, int] = {}
    for i, p in enumerate(passages):
        if p.id in seen:
            raise DatasetFormatError(
                path, f"record {i}", f"duplicate id {p.id!r} (first at record {seen[p.id]})"
            )
        seen[p.id] = i
    return passages


def render_hits(hits: list[dict[str, Any]]) -> str:
    """Search-R1's rendering: ``Doc 1(Title: T) text`` per hit, one per line."""
    if not hits:
        return "no results"
    lines = []
    for i, hit in enumerate(hits, start=1):
        title, text = parse_contents(hit["contents"])
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "\n".join(lines)


class MultiHopQAEnv(ToolEnv):
    """search (top-k passages over a corpus) + answer; reward = EM over the golds (F1 in info)."""

    name = "multihop_qa"

    def __init__(
        self, corpus_index: Retriever, topk: int = 3, max_turns: int = 8, system_prompt: str = SYSTEM_PROMPT
    ) -> None:
        self.index, self.topk = corpus_index, topk
        search = Tool("search", "Search Wikipedia; returns the top passages.", "query", self.search)
        super().__init__([search], system_prompt, max_turns)

    @classmethod
    def from_passages(cls, passages: Sequence[Passage], **kwargs: Any) -> MultiHopQAEnv:
        return cls(Bm25Index.from_passages(passages), **kwargs)

    def search(self, query: str) -> str:
        return render_hits(self.index.search([query], self.topk)[0])
