"""Search-R1's /retrieve contract (request checks naming the field, both response shapes, the client's
shape checks) and the env.retriever* config keys with their rules."""

from __future__ import annotations

import json

import pytest

from actors.envs.retrieval import (
    MAX_TOPK,
    RequestError,
    RetrieveRequest,
    chunks,
    format_result,
    parse_request,
    parse_result,
)
from configs.schema import ConfigError, load_config

HITS = [
    [{"id": "d1", "contents": '"T"\ntext', "score": 2.5}, {"id": "d2", "contents": "x", "score": 1.0}],
    [],
]


def test_request_defaults_and_round_trip():
    req = parse_request(b'{"queries": ["a", "b"]}')
    assert req == RetrieveRequest(["a", "b"], 3, False)
    assert parse_request(RetrieveRequest(["q"], 7, True).body()) == RetrieveRequest(["q"], 7, True)
    assert parse_request(b'{"queries": [], "topk": null}').queries == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"not json", "body"),
        (b"[1, 2]", "body"),
        (b"\xff\xfe", "body"),
        (b'{"topk": 3}', "queries"),
        (b'{"queries": "one string"}', "queries"),
        (b'{"queries": ["a", 3]}', "queries[1]"),
        (b'{"queries": ["a"], "topk": 0}', "topk"),
        (b'{"queries": ["a"], "topk": "3"}', "topk"),
        (b'{"queries": ["a"], "topk": true}', "topk"),
        (f'{{"queries": ["a"], "topk": {MAX_TOPK + 1}}}'.encode(), "topk"),
        (b'{"queries": ["a"], "return_scores": "yes"}', "return_scores"),
        (b'{"queries": ["a"], "top_k": 3}', "top_k"),
    ],
)
def test_bad_requests_name_the_field(body, field):
    with pytest.raises(RequestError) as info:
        parse_request(body)
    assert info.value.field == field
    payload = info.value.payload()
    assert payload["field"] == field and payload["error"].startswith(f"{field}: ")


def test_response_shapes_follow_search_r1():
    with_scores = format_result(HITS, return_scores=True)
    assert with_scores == {
        "result": [
            [
                {"document": {"id": "d1", "contents": '"T"\ntext'}, "score": 2.5},
                {"document": {"id": "d2", "contents": "x"}, "score": 1.0},
            ],
            [],
        ]
    }
    docs_only = format_result(HITS, return_scores=False)
    assert docs_only["result"][0] == [{"id": "d1", "contents": '"T"\ntext'}, {"id": "d2", "contents": "x"}]
    assert parse_result(json.loads(json.dumps(with_scores)), 2) == HITS
    assert parse_result(docs_only, 2)[0][0] == {"id": "d1", "contents": '"T"\ntext', "score": None}


NOT_A_DOCUMENT = r"^result\[0\]\[0\] is not a document with 'id' and 'contents' \(and a score\)$"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (None, r"^response has no 'result' list$"),
        ({"results": []}, r"^response has no 'result' list$"),
        ({"result": [[]]}, r"^response has 1 result lists for 2 queries$"),  # one list for two queries
        ({"result": [[], "x"]}, r"^result\[1\] is not a list$"),
        ({"result": [[{"document": {"id": "a"}, "score": 1.0}], []]}, NOT_A_DOCUMENT),  # no contents
        ({"result": [[{"document": {"id": "a", "contents": "c"}, "score": "high"}], []]}, NOT_A_DOCUMENT),
        (
            {"result": [[{"document": {"id": "a", "contents": "c"}, "score": float("nan")}], []]},
            NOT_A_DOCUMENT,
        ),
    ],
)
def test_malformed_responses_are_rejected(payload, message):
    with pytest.raises(ValueError, match=message):
        parse_result(payload, 2)


def test_chunks_keep_order():
    assert chunks(["a", "b", "c", "d", "e"], 2) == [["a", "b"], ["c", "d"], ["e"]]
    assert chunks([], 3) == []


def test_retriever_config_keys_and_rules():
    cfg = load_config()
    assert (cfg.env.retriever, cfg.env.retriever_url, cfg.env.index) == ("local", None, "bm25")
    good = ["env.retriever=service", "env.retriever_url=http://10.0.0.5:8000", "env.retriever_retries=0"]
    assert load_config(overrides=good).env.retriever_url == "http://10.0.0.5:8000"
    dense = load_config(overrides=["env.retriever=service", "env.index=dense", "env.encoder=/m"])
    assert dense.env.encoder == "/m"
    bad = [
        ("env.retriever=remote", r"^env\.retriever = 'remote' is invalid: allowed values are 'local', 'serv"),
        ("env.retriever_url=ftp://x", r"^env\.retriever_url = 'ftp://x' is invalid: expected an http:// or"),
        ("env.retriever_timeout_s=0", r"^env\.retriever_timeout_s = 0\.0 is invalid: expected a number > 0"),
        ("env.retriever_retries=-1", r"^env\.retriever_retries = -1 is invalid: expected an integer >= 0"),
        ("env.retriever_token=''", r"^env\.retriever_token = '' is invalid: expected a non-empty string"),
        ("env.index=splade", r"^env\.index = 'splade' is invalid: allowed values are 'bm25', 'dense'"),
        ("env.retriever_url=http://h:1", r"^env\.retriever = 'local' is invalid: expected 'service' when"),
    ]
    for override, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=[override])
    with pytest.raises(
        ConfigError, match=r"^env\.encoder = None is invalid: expected a local encoder folder"
    ):
        load_config(overrides=["env.retriever=service", "env.index=dense"])
    with pytest.raises(
        ConfigError, match=r"^env\.index = 'dense' is invalid: expected 'bm25' with env\.retr"
    ):
        load_config(overrides=["env.index=dense", "env.encoder=/m"])
