"""Dataset loaders on fixture files in every format, their errors, and BrowseComp-Plus decryption."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import fixtures_data as fx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.envs.deep_research import (
    decrypt_string,
    derive_key,
    encrypt_string,
    load_documents,
    load_qrels,
    load_queries,
    parse_header,
)
from actors.envs.multihop_qa import detect_format, load_corpus, load_dataset
from actors.envs.records import DatasetFormatError

# --- HotpotQA / 2Wiki / MuSiQue ---------------------------------------------------------------------------


def test_hotpot_official_fields(tmp_path: Path) -> None:
    ds = load_dataset(fx.write_hotpot_official(tmp_path))
    assert ds.name == "hotpotqa" and len(ds.tasks) == 2
    t = ds.tasks[1]
    assert t.task_id == "5a8c7595554299585d9e36b6" and t.answers == ("Chief of Protocol",)
    assert t.question.startswith("What position") and t.dataset == "hotpotqa"
    assert t.meta["type"] == "bridge" and t.meta["level"] == "medium"
    assert t.meta["supporting_facts"] == [["Kiss and Tell (1945 film)", 0], ["Shirley Temple", 1]]
    # 5 context paragraphs, "Ed Wood" twice -> 4 passages; sentences joined with single spaces
    assert [p.id for p in ds.passages] == [
        "Scott Derrickson",
        "Ed Wood",
        "Kiss and Tell (1945 film)",
        "Shirley Temple",
    ]
    assert ds.passages[0].text == "Scott Derrickson (born 1966) is an American director. He lives in LA."
    assert ds.passages[0].contents.startswith('"Scott Derrickson"\n')
    assert t.meta["context_ids"] == ["Kiss and Tell (1945 film)", "Shirley Temple", "Ed Wood"]


def test_hotpot_layouts_give_identical_tasks(tmp_path: Path) -> None:
    official = load_dataset(fx.write_hotpot_official(tmp_path))
    hf_rows = load_dataset(fx.write_hotpot_hf_jsonl(tmp_path))
    hf_cols = load_dataset(fx.write_hotpot_hf_columns(tmp_path), fmt="hotpotqa")
    assert official.tasks == hf_rows.tasks == hf_cols.tasks
    assert official.passages == hf_rows.passages == hf_cols.passages


def test_hotpot_test_file_without_answers(tmp_path: Path) -> None:
    rows = [
        {k: v for k, v in x.items() if k not in ("answer", "supporting_facts")} for x in fx.HOTPOT_OFFICIAL
    ]
    ds = load_dataset(fx.write_text(tmp_path, "hotpot_test.json", json.dumps(rows)))
    assert [t.answers for t in ds.tasks] == [(), ()]


def test_2wiki_fields(tmp_path: Path) -> None:
    ds = load_dataset(fx.write_2wiki(tmp_path))
    assert ds.name == "2wikimultihopqa"
    t = ds.tasks[0]
    assert t.answers == ("Małgorzata Braunek",) and t.meta["type"] == "compositional"
    assert t.meta["entity_ids"] == "Q7209321_Q9377"
    assert t.meta["evidences"][1] == ["Xawery Żuławski", "mother", "Małgorzata Braunek"]
    assert ds.passages[1].text == "Xawery Żuławski is a Polish director. His mother is Małgorzata Braunek."


def test_musique_fields(tmp_path: Path) -> None:
    ds = load_dataset(fx.write_musique(tmp_path))
    t0, t1 = ds.tasks
    assert t0.task_id == "2hop__460946_294723" and t0.answers == ("Miquette Giraudy", "Giraudy")
    assert t0.meta["hops"] == 2 and t1.meta["hops"] == 3 and t1.answers == ("Paris",)
    assert t0.meta["decomposition"][1] == {
        "id": 294723,
        "question": "#1 >> spouse",
        "answer": "Miquette Giraudy",
        "paragraph_support_idx": 1,
    }
    assert t1.meta["decomposition"][1]["paragraph_support_idx"] is None
    # "Green" has two different texts -> ids "Green" and "Green#2"
    assert [p.id for p in ds.passages] == ["Green", "Miquette Giraudy", "Steve Hillage", "Green#2", "Gong"]
    assert t0.meta["supporting_ids"] == ["Miquette Giraudy", "Steve Hillage"]
    assert t1.meta["context_ids"] == ["Green#2", "Gong"]


# --- Bamboogle / FlashRAG / wiki-18 -----------------------------------------------------------------------


def test_bamboogle_csv_and_jsonl_agree(tmp_path: Path) -> None:
    csv_ds = load_dataset(fx.write_bamboogle_csv(tmp_path))
    jsonl_ds = load_dataset(fx.write_bamboogle_jsonl(tmp_path))
    assert csv_ds.tasks == jsonl_ds.tasks and len(csv_ds.tasks) == 3
    t = csv_ds.tasks[1]
    assert t.task_id == "bamboogle-1" and t.answers == ("Saturn V",)
    assert t.question == fx.BAMBOOGLE[1]["Question"]  # quotes and commas survive CSV quoting
    assert csv_ds.passages == []


def test_flashrag_fields(tmp_path: Path) -> None:
    ds = load_dataset(fx.write_flashrag(tmp_path))
    assert ds.name == "hotpotqa"  # the parent folder, as in <dataset>/test.jsonl
    t = ds.tasks[0]
    assert (t.task_id, t.answers, t.meta) == ("test_0", ("Paris", "City of Paris"), {"type": "bridge"})
    assert ds.tasks[1].meta == {}


def test_wiki18_corpus(tmp_path: Path) -> None:
    passages = load_corpus(fx.write_wiki18(tmp_path))
    assert [(p.id, p.title) for p in passages] == [("0", "Paris"), ("1", "Hamlet"), ("2", "Eiffel Tower")]
    assert passages[2].text == "The Eiffel Tower is a lattice tower in Paris."
    assert passages[2].contents == fx.WIKI18[2]["contents"]  # contents round-trips


def test_detect_format(tmp_path: Path) -> None:
    expected = {
        fx.write_hotpot_official: "hotpotqa",
        fx.write_2wiki: "2wikimultihopqa",
        fx.write_musique: "musique",
        fx.write_flashrag: "flashrag",
        fx.write_wiki18: "wiki18",
        fx.write_bamboogle_jsonl: "bamboogle",
    }
    for writer, fmt in expected.items():
        path = writer(tmp_path)
        first = (
            json.loads(path.read_text().splitlines()[0])
            if path.suffix == ".jsonl"
            else json.loads(path.read_text())[0]
        )
        assert detect_format(path, first) == fmt
    with pytest.raises(DatasetFormatError, match="cannot detect"):
        detect_format(tmp_path / "x.jsonl", {"foo": 1})


# --- bad files --------------------------------------------------------------------------------------------


def _broken(tmp_path: Path, name: str, text: str) -> DatasetFormatError:
    path = fx.write_text(tmp_path, name, text)
    with pytest.raises(DatasetFormatError) as info:
        load_dataset(path)
    assert str(path) in str(info.value)
    return info.value


def test_truncated_json_names_file_and_position(tmp_path: Path) -> None:
    text = json.dumps(fx.HOTPOT_OFFICIAL, indent=1)
    err = _broken(tmp_path, "hotpot.json", text[: len(text) // 2])
    assert err.where.startswith("line ") and "truncated" in err.problem


def test_bad_jsonl_line(tmp_path: Path) -> None:
    good = json.dumps(fx.FLASHRAG[0])
    err = _broken(tmp_path, "nq/test.jsonl", f"{good}\n\n{good[:-5]}\n")
    assert err.where == "line 3" and err.problem.startswith("bad JSON")  # the blank line 2 is not a record


def test_missing_key_names_record(tmp_path: Path) -> None:
    rows = [dict(fx.FLASHRAG[0]), {"id": "test_1", "question": "Who?"}]
    err = _broken(tmp_path, "nq/dev.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    assert (err.where, err.problem) == ("line 2", "missing key 'golden_answers'")


def test_wrong_type_names_record_and_key(tmp_path: Path) -> None:
    rows = [dict(fx.FLASHRAG[0], golden_answers="Paris")]
    err = _broken(tmp_path, "nq/dev.jsonl", json.dumps(rows[0]) + "\n")
    assert err.problem == "key 'golden_answers' should be list, got str"
    bad_hotpot = [fx.HOTPOT_OFFICIAL[0], dict(fx.HOTPOT_OFFICIAL[1], question=42)]
    err = _broken(tmp_path, "hotpot.json", json.dumps(bad_hotpot))
    assert err.where == "index 1" and "'question' should be str, got int" in err.problem


def test_nested_errors_are_located(tmp_path: Path) -> None:
    item = json.loads(json.dumps(fx.MUSIQUE[0]))
    del item["paragraphs"][1]["paragraph_text"]
    err = _broken(tmp_path, "musique.jsonl", json.dumps(item) + "\n")
    assert err.where == "line 1, paragraphs[1]" and err.problem == "missing key 'paragraph_text'"
    bad_ctx = dict(fx.HOTPOT_OFFICIAL[0], context=[["Ed Wood", "not a list"]])
    err = _broken(tmp_path, "hotpot.json", json.dumps([bad_ctx]))
    assert err.where == "index 0" and "context[0]" in err.problem


def test_csv_errors(tmp_path: Path) -> None:
    err = _broken(tmp_path, "b1.csv", "Question,Reply\nWho?,Me\n")
    assert err.where == "line 1 (header)" and "missing column" in err.problem
    err = _broken(tmp_path, "b2.csv", "Question,Answer\nWho?,Me\nWhere?\n")
    assert err.where == "line 3" and err.problem == "wrong number of fields"


def test_top_level_errors(tmp_path: Path) -> None:
    assert _broken(tmp_path, "a.json", '"just a string"').where == "top level"
    assert _broken(tmp_path, "b.json", "[1, 2]").where == "index 0"
    assert _broken(tmp_path, "c.jsonl", "").problem == "no records"
    assert _broken(tmp_path, "d.json", '{"id": [1, 2], "question": ["x"]}').where == "top level"
    assert isinstance(_broken(tmp_path, "e.json", "[1]"), ValueError)
    with pytest.raises(FileNotFoundError, match=r"^dataset file not found: .*missing\.json$"):
        load_dataset(tmp_path / "missing.json")


# --- BrowseComp-Plus --------------------------------------------------------------------------------------


def test_known_vector_by_hand() -> None:
    # sha256("abc") = ba7816bf 8f01cfea ... (the FIPS 180-2 test vector), so the key starts 0xba 0x78.
    assert hashlib.sha256(b"abc").hexdigest().startswith("ba7816bf")
    # "Hi" = 0x48 0x69; 0x48 ^ 0xba = 0xf2, 0x69 ^ 0x78 = 0x11 -> bytes f2 11
    # base64: 11110010 00010001 -> 111100|100001|000100(pad) = 60, 33, 4 -> "8", "h", "E", "=" -> "8hE="
    assert encrypt_string("Hi", "abc") == "8hE="
    assert base64.b64decode("8hE=") == bytes([0xF2, 0x11])
    assert decrypt_string("8hE=", "abc") == "Hi"


def test_derive_key_repeats_sha256() -> None:
    digest = hashlib.sha256(b"abc").digest()
    assert derive_key("abc", 70) == digest + digest + digest[:6]  # 32 + 32 + 6 bytes
    assert derive_key("abc", 0) == b""


@pytest.mark.parametrize("text", ["", "Lake Vostok", "ünïcødé ✓ " * 20, "x" * 33])
def test_encrypt_decrypt_roundtrip(text: str) -> None:
    assert decrypt_string(encrypt_string(text, fx.CANARY), fx.CANARY) == text


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200), st.text(max_size=40))
def test_encrypt_decrypt_roundtrip_property(text: str, canary: str) -> None:
    assert decrypt_string(encrypt_string(text, canary), canary) == text


def test_decrypt_errors() -> None:
    with pytest.raises(ValueError, match="not base64"):
        decrypt_string("***", "abc")
    with pytest.raises(ValueError, match="not UTF-8"):
        decrypt_string(encrypt_string("ünïcødé", "right"), "wrong")


def test_queries_plain_and_encrypted_agree(tmp_path: Path) -> None:
    plain = load_queries(fx.write_browsecomp_queries(tmp_path))
    enc = fx.write_browsecomp_queries(tmp_path, encrypted=True)
    assert load_queries(enc, decrypt=True, canary=fx.CANARY) == plain
    with_field = fx.write_browsecomp_queries(tmp_path / "f", encrypted=True, canary_field=True)
    assert load_queries(with_field, decrypt=True) == plain  # each row's own canary
    t = plain[0]
    assert (t.task_id, t.answers, t.dataset) == ("784", ("Lake Vostok",), "browsecomp_plus")
    assert t.meta == {"evidence_docids": ["101"], "gold_docids": ["101"], "negative_docids": ["102"]}
    assert plain[1].meta["gold_docids"] == []
    with pytest.raises(DatasetFormatError, match="line 1: cannot decrypt 'query'"):
        load_queries(enc, decrypt=True, canary="wrong canary")
    with pytest.raises(DatasetFormatError, match="missing key 'canary'"):
        load_queries(enc, decrypt=True)


def test_corpus_header_parsing(tmp_path: Path) -> None:
    docs = load_documents(fx.write_browsecomp_corpus(tmp_path))
    assert [(d.docid, d.title) for d in docs] == [
        ("101", "Lake Vostok survey"),
        ("102", ""),
        ("103", "Expedition archive"),
    ]
    assert docs[0].text == "The 1996 survey confirmed Lake Vostok." and docs[0].header["date"] == "2019-03-01"
    assert docs[1].text == fx.BC_CORPUS[1]["text"] and docs[0].url == "https://example.org/lake"
    assert parse_header("---\ntitle: no end\nbody") == ({}, "---\ntitle: no end\nbody")  # unterminated
    dup = fx.write_text(
        tmp_path, "dup.jsonl", json.dumps(fx.BC_CORPUS[0]) + "\n" + json.dumps(fx.BC_CORPUS[0]) + "\n"
    )
    with pytest.raises(DatasetFormatError, match="line 2: duplicate docid '101'"):
        load_documents(dup)


def test_qrels(tmp_path: Path) -> None:
    assert load_qrels(fx.write_qrels(tmp_path)) == {"784": {"101": 1, "102": 0}, "785": {"103": 1}}
    bad = fx.write_text(tmp_path, "q.txt", "784 0 101 1\n784 101 1\n")
    with pytest.raises(DatasetFormatError, match="line 2"):
        load_qrels(bad)
