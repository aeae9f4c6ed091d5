"""Writers of tiny fixture files in every dataset format the loaders read (docs/design.md §9.1).

The project never ships or downloads real data: tests call these with a tmp dir. The records are short
made-up-but-plausible items; the constants below are what the loaders must map them to.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from actors.envs.deep_research import encrypt_string

# --- HotpotQA (official layout) ---------------------------------------------------------------------------
HOTPOT_OFFICIAL: list[dict[str, Any]] = [
    {
        "_id": "5a8b57f25542995d1e6f1371",
        "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
        "answer": "yes",
        "supporting_facts": [["Scott Derrickson", 0], ["Ed Wood", 0]],
        "context": [
            [
                "Scott Derrickson",
                ["Scott Derrickson (born 1966) is an American director.", " He lives in LA."],
            ],
            ["Ed Wood", ["Edward Davis Wood Jr. was an American filmmaker."]],
        ],
        "type": "comparison",
        "level": "hard",
    },
    {
        "_id": "5a8c7595554299585d9e36b6",
        "question": "What position was held by the woman who portrayed Corliss Archer in Kiss and Tell?",
        "answer": "Chief of Protocol",
        "supporting_facts": [["Kiss and Tell (1945 film)", 0], ["Shirley Temple", 1]],
        "context": [
            ["Kiss and Tell (1945 film)", ["Kiss and Tell stars Shirley Temple as Corliss Archer."]],
            ["Shirley Temple", ["Shirley Temple was an American actress.", " She was Chief of Protocol."]],
            ["Ed Wood", ["Edward Davis Wood Jr. was an American filmmaker."]],  # repeated paragraph
        ],
        "type": "bridge",
        "level": "medium",
    },
]


def hotpot_to_hf(item: dict[str, Any]) -> dict[str, Any]:
    """The HF ``hotpot_qa`` layout: ``id`` and column-wise context / supporting_facts."""
    return {
        "id": item["_id"],
        "question": item["question"],
        "answer": item["answer"],
        "type": item["type"],
        "level": item["level"],
        "supporting_facts": {
            "title": [t for t, _ in item["supporting_facts"]],
            "sent_id": [i for _, i in item["supporting_facts"]],
        },
        "context": {"title": [t for t, _ in item["context"]], "sentences": [s for _, s in item["context"]]},
    }


# --- 2WikiMultiHopQA --------------------------------------------------------------------------------------
TWOWIKI: list[dict[str, Any]] = [
    {
        "_id": "8813f87c0bdd11eba7f7acde48001122",
        "type": "compositional",
        "question": "Who is the mother of the director of film Polish-Russian War?",
        "context": [
            ["Polish-Russian War (film)", ["Polish-Russian War is a 2009 film directed by Xawery Żuławski."]],
            [
                "Xawery Żuławski",
                ["Xawery Żuławski is a Polish director.", "His mother is Małgorzata Braunek."],
            ],
        ],
        "supporting_facts": [["Polish-Russian War (film)", 0], ["Xawery Żuławski", 1]],
        "evidences": [
            ["Polish-Russian War", "director", "Xawery Żuławski"],
            ["Xawery Żuławski", "mother", "Małgorzata Braunek"],
        ],
        "answer": "Małgorzata Braunek",
        "entity_ids": "Q7209321_Q9377",
    },
    {
        "_id": "028eaef60bdb11eba7f7acde48001122",
        "type": "comparison",
        "question": "Which film came out first, Blind Shaft or The Mask Of Fu Manchu?",
        "context": [
            ["Blind Shaft", ["Blind Shaft is a 2003 film."]],
            ["The Mask of Fu Manchu", ["The Mask of Fu Manchu is a 1932 film."]],
        ],
        "supporting_facts": [["Blind Shaft", 0], ["The Mask of Fu Manchu", 0]],
        "evidences": [
            ["Blind Shaft", "publication date", "2003"],
            ["The Mask of Fu Manchu", "publication date", "1932"],
        ],
        "answer": "The Mask Of Fu Manchu",
        "entity_ids": "Q4484258_Q1114216",
    },
]

# --- MuSiQue (JSONL) --------------------------------------------------------------------------------------
MUSIQUE: list[dict[str, Any]] = [
    {
        "id": "2hop__460946_294723",
        "paragraphs": [
            {"idx": 0, "title": "Green", "paragraph_text": "Green is a color.", "is_supporting": False},
            {
                "idx": 1,
                "title": "Miquette Giraudy",
                "paragraph_text": "Giraudy is Steve Hillage's partner.",
                "is_supporting": True,
            },
            {
                "idx": 2,
                "title": "Steve Hillage",
                "paragraph_text": "Hillage played with Gong.",
                "is_supporting": True,
            },
        ],
        "question": "Who is the spouse of the Green performer?",
        "question_decomposition": [
            {
                "id": 460946,
                "question": "Green >> performer",
                "answer": "Steve Hillage",
                "paragraph_support_idx": 2,
            },
            {
                "id": 294723,
                "question": "#1 >> spouse",
                "answer": "Miquette Giraudy",
                "paragraph_support_idx": 1,
            },
        ],
        "answer": "Miquette Giraudy",
        "answer_aliases": ["Giraudy"],
        "answerable": True,
    },
    {
        "id": "3hop1__9285_5188_23307",
        "paragraphs": [
            {
                "idx": 0,
                "title": "Green",
                "paragraph_text": "Green was a Hillage album.",
                "is_supporting": True,
            },
            {"idx": 1, "title": "Gong", "paragraph_text": "Gong formed in Paris.", "is_supporting": True},
        ],
        "question": "Where was the band of the Green performer formed?",
        "question_decomposition": [
            {
                "id": 9285,
                "question": "Green >> performer",
                "answer": "Steve Hillage",
                "paragraph_support_idx": 0,
            },
            {"id": 5188, "question": "#1 >> member of", "answer": "Gong", "paragraph_support_idx": None},
            {
                "id": 23307,
                "question": "#2 >> location of formation",
                "answer": "Paris",
                "paragraph_support_idx": 1,
            },
        ],
        "answer": "Paris",
        "answer_aliases": [],
        "answerable": True,
    },
]

# --- Bamboogle (CSV and HF rows) --------------------------------------------------------------------------
BAMBOOGLE: list[dict[str, str]] = [
    {
        "Question": "Who was president of the United States in the year that Citibank was founded?",
        "Answer": "james madison",
    },
    {
        "Question": 'What rocket was first used in the year "Apollo 11" landed, in a comma, test?',
        "Answer": "Saturn V",
    },
    {"Question": "What is the capital of the country where the Eiffel Tower stands?", "Answer": "Paris"},
]

# --- FlashRAG / Search-R1 QA and the wiki-18 corpus -------------------------------------------------------
FLASHRAG: list[dict[str, Any]] = [
    {
        "id": "test_0",
        "question": "Which city is the capital of France?",
        "golden_answers": ["Paris", "City of Paris"],
        "metadata": {"type": "bridge"},
    },
    {"id": "test_1", "question": "Who wrote Hamlet?", "golden_answers": ["William Shakespeare"]},
]
WIKI18: list[dict[str, str]] = [
    {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "1", "contents": '"Hamlet"\nHamlet is a tragedy written by William Shakespeare.'},
    {"id": "2", "contents": '"Eiffel Tower"\nThe Eiffel Tower is a lattice tower in Paris.'},
]

# --- BrowseComp-Plus --------------------------------------------------------------------------------------
CANARY = "fixture canary 1f3a"  # not the real BrowseComp canary; the scheme is what the test checks
BC_LONG_BODY = "The archive lists every expedition. " * 40  # 1,440 characters: exercises open's budget
BC_CORPUS: list[dict[str, str]] = [
    {
        "docid": "101",
        "url": "https://example.org/lake",
        "text": "---\ntitle: Lake Vostok survey\ndate: 2019-03-01\n---\n"
        "The 1996 survey confirmed Lake Vostok.",
    },
    {"docid": "102", "url": "https://example.org/no-header", "text": "A page about penguins in Antarctica."},
    {
        "docid": "103",
        "url": "https://example.org/archive",
        "text": "---\ntitle: Expedition archive\n---\n" + BC_LONG_BODY,
    },
]
BC_QUERIES: list[dict[str, Any]] = [
    {
        "query_id": "784",
        "query": "Which lake beneath a research station was confirmed by a 1996 survey?",
        "answer": "Lake Vostok",
        "evidence_docs": [{"docid": "101", "text": "The 1996 survey...", "url": "https://example.org/lake"}],
        "gold_docs": [{"docid": "101", "text": "The 1996 survey...", "url": "https://example.org/lake"}],
        "negative_docs": [
            {"docid": "102", "text": "A page about penguins.", "url": "https://example.org/no-header"}
        ],
    },
    {"query_id": "785", "query": "What does the expedition archive list?", "answer": "every expedition"},
]
BC_QRELS = "784 0 101 1\n784 0 102 0\n785 0 103 1\n"


def _write_json(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1), encoding="utf-8")
    return path


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def write_hotpot_official(d: Path) -> Path:
    return _write_json(d / "hotpot_dev_distractor_v1.json", HOTPOT_OFFICIAL)


def write_hotpot_hf_jsonl(d: Path) -> Path:
    return _write_jsonl(d / "hotpot_qa_hf.jsonl", [hotpot_to_hf(x) for x in HOTPOT_OFFICIAL])


def write_hotpot_hf_columns(d: Path) -> Path:
    """HF ``Dataset.to_dict()`` output: one JSON object of columns."""
    rows = [hotpot_to_hf(x) for x in HOTPOT_OFFICIAL]
    return _write_json(d / "hotpot_qa_columns.json", {k: [r[k] for r in rows] for k in rows[0]})


def write_2wiki(d: Path) -> Path:
    return _write_json(d / "dev.json", TWOWIKI)


def write_musique(d: Path) -> Path:
    return _write_jsonl(d / "musique_ans_v1.0_dev.jsonl", MUSIQUE)


def write_bamboogle_csv(d: Path) -> Path:
    path = d / "bamboogle.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["Question", "Answer"])
        writer.writeheader()
        writer.writerows(BAMBOOGLE)
    return path


def write_bamboogle_jsonl(d: Path) -> Path:
    return _write_jsonl(d / "bamboogle_test.jsonl", BAMBOOGLE)


def write_flashrag(d: Path) -> Path:
    return _write_jsonl(d / "hotpotqa" / "test.jsonl", FLASHRAG)


def write_wiki18(d: Path) -> Path:
    return _write_jsonl(d / "wiki-18.jsonl", WIKI18)


def write_browsecomp_corpus(d: Path) -> Path:
    return _write_jsonl(d / "browsecomp_plus_corpus.jsonl", BC_CORPUS)


def _encrypt_tree(value: Any, canary: str) -> Any:
    if isinstance(value, str):
        return encrypt_string(value, canary)
    if isinstance(value, list):
        return [_encrypt_tree(v, canary) for v in value]
    if isinstance(value, dict):
        return {k: _encrypt_tree(v, canary) for k, v in value.items()}
    return value


def write_browsecomp_queries(d: Path, encrypted: bool = False, canary_field: bool = False) -> Path:
    """Plain (decrypted) rows, or rows encrypted like the published set (every string but query_id);
    ``canary_field`` also stores the canary in each row, as BrowseComp does."""
    rows = []
    for q in BC_QUERIES:
        row = {k: (v if k == "query_id" or not encrypted else _encrypt_tree(v, CANARY)) for k, v in q.items()}
        if canary_field:
            row["canary"] = CANARY
        rows.append(row)
    name = "browsecomp_plus_encrypted.jsonl" if encrypted else "browsecomp_plus_decrypted.jsonl"
    return _write_jsonl(d / name, rows)


def write_qrels(d: Path) -> Path:
    path = d / "topics-qrels" / "qrel_evidence.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(BC_QRELS, encoding="utf-8")
    return path


def write_text(d: Path, name: str, text: str) -> Path:
    """A hand-broken file for the error tests."""
    path = d / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
