"""The retrieval service on loopback: Search-R1's shape with the in-process index's top-k and scores,
batching, 400/401/404, the saved index reused across starts, and the client's timeout, retries and tool-error
observation when the service fails."""

from __future__ import annotations

import time

import pytest

from actors.envs import multihop_qa
from actors.envs import retrieval_index as ri
from actors.envs.multihop_qa import MultiHopQAEnv, load_corpus
from actors.envs.retrieval_client import RetrievalClient, RetrievalError
from actors.envs.retrieval_index import open_index
from actors.envs.retrieval_server import RetrievalServer
from actors.envs.search import Bm25Index
from tests.retrieval_fixtures import ScriptedServer, Silent, good_body, post, write_corpus

QUERIES = ["mentor of the person", "Fact capital country", "zzzz qqqq", "", "employer Corp Labs"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "wiki.jsonl")


@pytest.fixture(scope="module")
def served(corpus):
    server = RetrievalServer(open_index(corpus).index).start()
    yield server
    server.stop()


class Counting:
    """An index wrapper that counts search calls (= requests the server handled)."""

    def __init__(self, index):
        self.index, self.calls, self.queries = index, 0, 0

    def __len__(self):
        return len(self.index)

    def search(self, queries, topk):
        self.calls, self.queries = self.calls + 1, self.queries + len(queries)
        return self.index.search(queries, topk)


def test_http_answers_match_the_in_process_index(corpus, served):
    local = Bm25Index.from_passages(load_corpus(corpus))  # what a sampler builds for itself today
    status, body = post(served.url, {"queries": QUERIES, "topk": 5, "return_scores": True})
    assert status == 200 and len(body["result"]) == len(QUERIES)
    for served_hits, own in zip(body["result"], local.search(QUERIES, 5), strict=True):
        assert [(h["document"]["id"], h["score"]) for h in served_hits] == [
            (h["id"], h["score"]) for h in own
        ]
        assert [h["document"]["contents"] for h in served_hits] == [h["contents"] for h in own]
    assert body["result"][2] == [] and body["result"][3] == []  # no indexed term: nothing
    assert len(body["result"][0]) == 5
    status, docs = post(served.url, {"queries": QUERIES[:1], "topk": 2})  # no scores: documents alone
    assert status == 200 and docs["result"][0] == [h["document"] for h in body["result"][0][:2]]
    client = RetrievalClient(served.url)
    assert client.search(QUERIES, 5) == local.search(QUERIES, 5)


def test_batches_are_one_request_each(corpus):
    index = Counting(open_index(corpus).index)
    server = RetrievalServer(index).start()
    try:
        queries = [f"mentor {i}" for i in range(50)] + QUERIES
        client = RetrievalClient(server.url, max_batch=8)
        hits = client.search(queries, 3)
        assert index.calls == 7 and index.queries == 55  # ceil(55 / 8) requests, every query once
        assert hits == index.index.search(queries, 3)
        assert client.search([], 3) == [] and index.calls == 7
    finally:
        server.stop()


def test_bad_requests_get_400_naming_the_field(served):
    for body, field in [
        (b"{not json", "body"),
        ({"topk": 3}, "queries"),
        ({"queries": ["a", None]}, "queries[1]"),
        ({"queries": ["a"], "topk": 0}, "topk"),
        ({"queries": ["a"], "return_scores": 1}, "return_scores"),
        ({"queries": ["a"], "k": 3}, "k"),
    ]:
        status, payload = post(served.url, body)
        assert status == 400 and payload["field"] == field and field in payload["error"]
    status, payload = post(served.url, {"queries": ["a"]}, path="/search")
    assert status == 404 and "/retrieve" in payload["error"]


def test_a_token_is_checked_on_every_request(corpus):
    with pytest.raises(PermissionError, match="needs a token"):
        RetrievalServer(None, host="0.0.0.0")  # refused before binding anything
    server = RetrievalServer(open_index(corpus).index, token="s3cret").start()
    try:
        body = {"queries": ["mentor"], "topk": 1}
        assert post(server.url, body)[0] == 401
        assert post(server.url, body, token="wrong")[0] == 401
        assert post(server.url, body, token="s3cret")[0] == 200
        stranger = RetrievalClient(server.url, retries=3, backoff_s=0.01)
        with pytest.raises(RetrievalError, match=r"HTTP 401.*\(1 try\)"):  # a 4xx is not retried
            stranger.search(["mentor"], 1)
        assert stranger.metrics()["env/retrieval_errors"] == 1.0
        assert len(RetrievalClient(server.url, token="s3cret").search_one("mentor", 2)) == 2
    finally:
        server.stop()


def test_the_index_is_saved_and_reused_until_the_corpus_changes(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "c.jsonl", n=200)
    first = open_index(corpus, index_dir=tmp_path / "idx")
    assert not first.reused and (tmp_path / "idx" / "bm25" / "manifest.json").is_file()

    def no_build(*args):
        raise AssertionError("rebuilt an index that was current")

    monkeypatch.setattr(ri, "_new_index", no_build)
    again = open_index(corpus, index_dir=tmp_path / "idx")
    assert again.reused and again.index.search(QUERIES, 4) == first.index.search(QUERIES, 4)
    st = corpus.stat()
    corpus.write_bytes(corpus.read_bytes())  # touched: new mtime, same bytes -> the sha256 matches
    assert (
        corpus.stat().st_mtime_ns != st.st_mtime_ns and open_index(corpus, index_dir=tmp_path / "idx").reused
    )
    monkeypatch.undo()
    write_corpus(corpus, n=200, extra=["Zyxwv quokka passage"])  # changed: rebuilt
    changed = open_index(corpus, index_dir=tmp_path / "idx")
    assert not changed.reused and changed.index.search_one("quokka", 1)[0]["id"] == "extra-0"
    assert [p.name for p in (tmp_path / "idx").iterdir()] == ["bm25"]  # no temp folders left behind
    default = open_index(corpus)
    assert default.directory == tmp_path / "c.jsonl.index" / "bm25" and not default.reused


def test_browsecomp_corpus_is_served_with_docids(tmp_path):
    path = tmp_path / "bc.jsonl"
    path.write_text('{"docid": "7", "text": "---\\ntitle: Quokka\\n---\\nA small marsupial.", "url": "u"}\n')
    hits = open_index(path).index.search_one("quokka marsupial", 3)
    assert [h["id"] for h in hits] == ["7"] and hits[0]["contents"] == "Quokka\nA small marsupial."


def test_client_times_out_and_retries_with_backoff():
    silent = Silent()
    try:
        client = RetrievalClient(silent.url, timeout_s=0.2, retries=2, backoff_s=0.05)
        t0 = time.perf_counter()
        with pytest.raises(RetrievalError, match=r"did not answer in time \(3 tries\)"):
            client.search(["q"], 3)
        elapsed = time.perf_counter() - t0
        assert 0.6 + 0.15 <= elapsed < 3.0  # 3 timeouts + backoffs of 0.05 and 0.1 s
        assert client.metrics() == {"env/retrieval_errors": 1.0, "env/retrieval_retries": 2.0}
    finally:
        silent.close()


def test_client_retries_5xx_malformed_json_and_wrong_shapes():
    script = [(500, b'{"error": "boom"}'), (200, b"<html>"), (200, b'{"result": []}'), (200, good_body(1))]
    server = ScriptedServer(script)
    try:
        client = RetrievalClient(server.url, retries=3, backoff_s=0.01)
        assert client.search(["q"], 1) == [[{"id": "d", "contents": "c", "score": 1.0}]]
        assert server.calls == 4 and client.metrics()["env/retrieval_errors"] == 0.0
        for status, body, why in [
            (503, b"{}", "HTTP 503"),
            (200, b"not json", "not JSON"),
            (200, b'{"result": [[{"id": 1}]]}', "malformed"),
        ]:
            server.script, server.calls = [(status, body)], 0
            with pytest.raises(RetrievalError, match=why):
                RetrievalClient(server.url, retries=1, backoff_s=0.01).search(["q"], 1)
            assert server.calls == 2
    finally:
        server.close()


def test_a_stopped_service_is_a_tool_error_observation(corpus):
    server = RetrievalServer(open_index(corpus).index).start()
    env = MultiHopQAEnv(RetrievalClient(server.url, retries=1, backoff_s=0.01), topk=2)
    task = multihop_qa.Task("t", "q?", ("a",), "test")
    ok = env.step(task, [], "search: mentor of the person")
    assert not ok.done and ok.observation.startswith("Doc 1(Title: Fact") and "error" not in ok.info
    assert env.metrics()["env/retrieval_errors"] == 0.0
    server.stop()
    down = env.step(task, [], "search: mentor of the person")
    assert not down.done and down.info["error"] == "tool_error"  # the episode goes on
    assert down.observation.startswith("error: search failed: the retrieval service at http://127.0.0.1:")
    assert "refused the connection" in down.observation
    assert env.metrics()["env/retrieval_errors"] == 1.0
    assert env.step(task, [], "answer: a").reward == 1.0
