"""Tool-call parsing (both protocols), the SQuAD/HotpotQA answer metrics and the BM25 search tool."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.envs.rewards import exact_match, f1, normalize_answer, precision_recall_f1
from actors.envs.search import Bm25Index, Passage
from actors.envs.tool_calls import ParseError, ToolCall, parse_tool_call

# --- parsing: plain lines ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name", "args"),
    [
        ("search: Tavo Mirel mentor", "search", {"query": "Tavo Mirel mentor"}),
        ("  search:   padded query  ", "search", {"query": "padded query"}),
        ("open: doc-17", "open", {"docid": "doc-17"}),
        ("answer: Quinto", "answer", {"answer": "Quinto"}),
        ("Answer: Paris", "answer", {"answer": "Paris"}),  # names are case-insensitive
        (
            "I should look this up.\nsearch: Eiffel Tower height\nthanks",
            "search",
            {"query": "Eiffel Tower height"},
        ),
        ("note: thinking\nsearch: known tool wins", "search", {"query": "known tool wins"}),
        ("<think>answer: not this</think>search: after think", "search", {"query": "after think"}),
        ("search:", "search", {"query": ""}),  # empty argument: the env reports it, the parser keeps it
    ],
)
def test_plain_lines(text: str, name: str, args: dict[str, str]) -> None:
    call = parse_tool_call(text)
    assert isinstance(call, ToolCall)
    assert (call.name, call.arguments) == (name, args)


def test_plain_unknown_tool_is_a_call_not_an_error() -> None:
    # The env answers "unknown tool 'calculator'"; the parser only reports what was asked for.
    call = parse_tool_call("calculator: 2+2")
    assert call == ToolCall("calculator", {"text": "2+2"}, "calculator: 2+2")


def test_plain_raw_is_the_matched_line() -> None:
    call = parse_tool_call("Let me check.\nsearch: X Corp founder\n")
    assert isinstance(call, ToolCall) and call.raw == "search: X Corp founder"


@pytest.mark.parametrize("text", ["I think the answer is Paris.", "", "   \n ", "Step 1 : think hard"])
def test_no_call_is_unattempted_parse_error(text: str) -> None:
    err = parse_tool_call(text)
    assert isinstance(err, ParseError)
    assert not err.attempted and err.reason == "no tool call found"


def test_custom_plain_argument_names() -> None:
    call = parse_tool_call("lookup: foo", {"lookup": "key"})
    assert call == ToolCall("lookup", {"key": "foo"}, "lookup: foo")


_TURN_PIECES = st.sampled_from(
    [
        "search:",
        "answer:",
        "<tool_call>",
        "</tool_call>",
        "<answer>",
        "</answer>",
        "<think>",
        "{",
        '"name"',
        "\n",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=20), _TURN_PIECES), max_size=12).map("".join))
def test_parser_never_raises(text: str) -> None:
    # Property: any model output parses to a call or a reasoned ParseError, never an exception.
    out = parse_tool_call(text)
    assert isinstance(out, ToolCall) or (isinstance(out, ParseError) and out.reason)


# --- parsing: Qwen3 JSON / tags ---------------------------------------------------------------------------


def test_qwen_tool_call() -> None:
    text = (
        'Let me search.\n<tool_call>\n{"name": "search", "arguments": {"query": "Lake Vostok"}}\n</tool_call>'
    )
    call = parse_tool_call(text)
    assert isinstance(call, ToolCall)
    assert (call.name, call.arguments) == ("search", {"query": "Lake Vostok"})
    assert call.raw.startswith("<tool_call>") and call.raw.endswith("</tool_call>")


def test_qwen_tool_call_without_close_tag_and_string_arguments() -> None:
    # "</tool_call>" is usually a stop string, so it is often missing; some models string-encode arguments.
    call = parse_tool_call('<tool_call>{"name": "open", "arguments": "{\\"docid\\": \\"101\\"}"}')
    assert isinstance(call, ToolCall) and (call.name, call.arguments) == ("open", {"docid": "101"})


def test_answer_tag_and_first_call_wins() -> None:
    call = parse_tool_call("<think>hmm</think><answer> Lake Vostok </answer><tool_call>{}</tool_call>")
    assert call == ToolCall("answer", {"answer": "Lake Vostok"}, "<answer> Lake Vostok </answer>")


@pytest.mark.parametrize(
    ("text", "reason_part"),
    [
        ('<tool_call>{"name": "search", "arguments": {"query": "x"}</tool_call>', "invalid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must hold a JSON object, got list"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a string "name"'),
        ('<tool_call>{"name": "search", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
        ('<tool_call>{"name": "search", "arguments": "{oops"}</tool_call>', "string that is not JSON"),
    ],
)
def test_malformed_json_is_attempted_parse_error(text: str, reason_part: str) -> None:
    err = parse_tool_call(text)
    assert isinstance(err, ParseError) and err.attempted
    assert reason_part in err.reason


# --- metrics ----------------------------------------------------------------------------------------------


def test_normalize_answer() -> None:
    # lower -> drop punctuation -> drop a/an/the -> collapse whitespace
    assert normalize_answer("The  Eiffel-Tower, Paris!") == "eiffeltower paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("Theory") == "theory"  # articles only as whole words


def test_exact_match_hand_worked() -> None:
    # "the Eiffel Tower" -> "eiffel tower"; "Eiffel tower" -> "eiffel tower": equal -> EM 1
    assert exact_match("the Eiffel Tower", "Eiffel tower") == 1.0
    assert exact_match("Eiffel Tower in Paris", ["Eiffel tower"]) == 0.0
    assert exact_match("Paris", ["City of Paris", "paris."]) == 1.0  # max over golds
    assert exact_match("Paris", []) == 0.0


def test_f1_hand_worked() -> None:
    # pred "Eiffel Tower in Paris" -> [eiffel, tower, in, paris]; gold "the Eiffel Tower" -> [eiffel, tower]
    # common = 2; precision = 2/4 = 0.5; recall = 2/2 = 1.0; F1 = 2*0.5*1/(0.5+1) = 1/1.5 = 0.6667
    assert f1("Eiffel Tower in Paris", "the Eiffel Tower") == pytest.approx(2 / 3)
    # pred [new, york, city] vs gold [york, city, hall, new, york]: Counter overlap new:1 york:1 city:1 = 3
    # precision 3/3 = 1, recall 3/5 = 0.6, F1 = 2*0.6/1.6 = 0.75
    assert precision_recall_f1("New York City", "York City Hall, New York") == pytest.approx((1.0, 0.6, 0.75))
    # max over golds: 0 vs 0.75 -> 0.75
    assert f1("New York City", ["Boston", "York City Hall, New York"]) == pytest.approx(0.75)


def test_f1_yes_no_special_case() -> None:
    # hotpot_evaluate_v1: "no" vs "no way" would share the token "no" (F1 2/3), but yes/no/noanswer must
    # match exactly, so F1 is 0; identical yes/no still scores 1.
    assert f1("no", "no way") == 0.0
    assert f1("no way", "no") == 0.0
    assert f1("Yes.", "yes") == 1.0
    assert f1("", "anything") == 0.0


# --- BM25 search ------------------------------------------------------------------------------------------

PASSAGES = [
    Passage("p0", "", "The mentor of Tavo Mirel is Kessa Dorn."),
    Passage("p1", "", "The capital of Zorbia is Quinto."),
    Passage("p2", "", "The birthplace of Kessa Dorn is Quinto."),
]


@pytest.fixture(scope="module")
def index() -> Bm25Index:
    return Bm25Index.from_passages(PASSAGES)


def test_search_contract(index: Bm25Index) -> None:
    (hits,) = index.search(["Tavo Mirel mentor"], topk=2)
    assert hits[0]["id"] == "p0" and hits[0]["contents"] == PASSAGES[0].text
    assert set(hits[0]) == {"id", "contents", "score"} and hits[0]["score"] > 0
    assert len(hits) == 1  # p1/p2 share no term with the query: zero-score documents are not returned


def test_search_topk_larger_than_corpus_and_order(index: Bm25Index) -> None:
    hits = index.search_one("Kessa Dorn Quinto", topk=50)
    assert len(hits) == 3
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)


def test_search_empty_stopword_and_unknown_queries(index: Bm25Index) -> None:
    assert index.search(["", "the of is", "zzzqqq"], topk=2) == [[], [], []]
    assert index.search([], topk=2) == []
    with pytest.raises(ValueError, match=r"^topk must be >= 1, got 0$"):
        index.search(["x"], topk=0)


def test_search_ties_break_by_corpus_order() -> None:
    idx = Bm25Index(["a", "b", "c"], ["alpha beta", "alpha beta", "alpha beta"])
    assert [h["id"] for h in idx.search_one("alpha", 2)] == ["a", "b"]


def test_index_save_load_roundtrip(index: Bm25Index, tmp_path) -> None:
    index.save(tmp_path / "idx")
    loaded = Bm25Index.load(tmp_path / "idx")
    queries = ["Tavo Mirel mentor", "Quinto", "capital Zorbia"]
    assert loaded.search(queries, 3) == index.search(queries, 3)
    assert loaded.text("p1") == PASSAGES[1].text and "p2" in loaded and len(loaded) == 3


def test_index_rejects_duplicates_and_empty() -> None:
    with pytest.raises(ValueError, match="duplicate passage id 'a'"):
        Bm25Index(["a", "a"], ["x y", "y z"])
    with pytest.raises(ValueError, match="empty corpus"):
        Bm25Index([], [])


def test_repeated_queries_come_from_the_cache_and_equal_a_fresh_search(monkeypatch) -> None:
    import actors.envs.search as search

    idx, fresh = Bm25Index.from_passages(PASSAGES), Bm25Index.from_passages(PASSAGES)
    queries = ["Tavo Mirel mentor", "Quinto", "Tavo Mirel mentor"]
    first = idx.search(queries, 2)
    # 3 queries, 2 distinct: all 3 missed (the repeat was in the same call), then 3 hits of 3
    assert (idx.cache_hits, idx.cache_misses) == (0, 3)
    first[0][0]["contents"] = "changed by the caller"  # callers get copies: the cache keeps its own
    again = idx.search(queries, 2)
    assert (idx.cache_hits, idx.cache_misses) == (3, 3)
    assert again == fresh.search(queries, 2) and again[0][0]["contents"] == PASSAGES[0].text
    idx.search_one("Quinto", 3)  # another topk is another entry
    assert idx.cache_misses == 4
    monkeypatch.setattr(search, "QUERY_CACHE", 2)
    idx.search_one("capital Zorbia", 2)  # 4 entries > 2: the two least recently used go
    assert list(idx._hits) == [("Quinto", 3), ("capital Zorbia", 2)]


WORDS = ["Tavo", "mirel", "MENTOR", "the", "of", "is", "Kessa", "dorn", "Quinto", "capital", "zorbia", "zzz"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([*WORDS, "a", "'s", "?", "-", " ", "Ünïcode", "x1"]), max_size=8))
def test_query_ids_score_as_bm25s_own_tokenize_does(index: Bm25Index, words: list[str]) -> None:
    """The per-query tokenizer (bm25s' Tokenizer on the index's vocabulary) against bm25s.tokenize, the
    function that indexed the corpus: same scores for every document, so the same hits."""
    import numpy as np

    from actors.envs.search import _tokenize

    idx = index  # module-scoped: one index for every example (searches only read it)
    query = " ".join(words)
    reference = [t for t in _tokenize([query], return_ids=False)[0] if t in idx._bm25.vocab_dict]
    (ids,) = idx._queries.streaming_tokenize([query], update_vocab=False, allow_empty=False)
    assert sorted(ids) == sorted(idx._bm25.get_tokens_ids(reference))
    if reference:
        assert np.array_equal(idx._bm25.get_scores_from_ids(ids), idx._bm25.get_scores(reference))
    else:
        assert idx.search_one(query, 3) == []
