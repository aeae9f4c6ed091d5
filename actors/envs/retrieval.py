"""Search-R1's ``/retrieve`` contract, shared by the retrieval service and its client (pure JSON in/out).

    POST /retrieve  {"queries": ["q1", "q2"], "topk": 3, "return_scores": true}
    200 {"result": [[{"document": {"id": "...", "contents": "..."}, "score": 11.2}, ...],   # q1, best first
                    [...]]}                                                                 # q2
    without return_scores (its default is false, as in Search-R1) each list holds the documents alone:
    200 {"result": [[{"id": "...", "contents": "..."}, ...], ...]}

``topk`` defaults to 3 (Search-R1's ``retrieval_topk``). A list can be shorter than ``topk`` (BM25 never
returns a document that shares no term with the query). A malformed request is a 400 whose JSON body names
the field: ``{"error": "topk: expected an integer in [1, 1000], got 0", "field": "topk"}``.

The bounds below keep one request from occupying the service: at most ``MAX_QUERIES`` queries of at most
``MAX_QUERY_CHARS`` characters each, ``topk`` at most ``MAX_TOPK``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_TOPK = 3
MAX_QUERIES = 4096
MAX_QUERY_CHARS = 8192
MAX_TOPK = 1000
FIELDS = ("queries", "topk", "return_scores")
Hits = list[list[dict[str, Any]]]  # per query: {"id", "contents", "score"}, best first (Bm25Index.search)


class RequestError(ValueError):
    """A malformed /retrieve request; ``field`` names the offending key ("body" for the body as a whole)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")

    def payload(self) -> dict[str, str]:
        return {"error": str(self), "field": self.field}


@dataclass(frozen=True)
class RetrieveRequest:
    queries: list[str]
    topk: int = DEFAULT_TOPK
    return_scores: bool = False

    def body(self) -> bytes:
        data = {"queries": self.queries, "topk": self.topk, "return_scores": self.return_scores}
        return json.dumps(data, ensure_ascii=False).encode()


def parse_request(body: bytes) -> RetrieveRequest:
    """A request body checked field by field; RequestError names the first bad field."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError("body", f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise RequestError("body", f"expected a JSON object, got {type(data).__name__}")
    for key in data:
        if key not in FIELDS:
            raise RequestError(str(key), f"unknown field; allowed: {', '.join(FIELDS)}")
    if "queries" not in data:
        raise RequestError("queries", "missing (a list of strings)")
    queries = data["queries"]
    if not isinstance(queries, list) or len(queries) > MAX_QUERIES:
        raise RequestError("queries", f"expected a list of at most {MAX_QUERIES} strings")
    for i, q in enumerate(queries):
        if not isinstance(q, str) or len(q) > MAX_QUERY_CHARS:
            raise RequestError(f"queries[{i}]", f"expected a string of at most {MAX_QUERY_CHARS} characters")
    topk = data.get("topk")
    topk = DEFAULT_TOPK if topk is None else topk
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
        raise RequestError("topk", f"expected an integer in [1, {MAX_TOPK}], got {json.dumps(topk)}")
    scores = data.get("return_scores", False)
    if not isinstance(scores, bool):
        raise RequestError("return_scores", f"expected true or false, got {json.dumps(scores)}")
    return RetrieveRequest(queries, topk, scores)


def format_result(hits: Hits, return_scores: bool) -> dict[str, Any]:
    """The response body for ``hits`` (one list per query, as ``Bm25Index.search`` returns them)."""
    result = []
    for per_query in hits:
        docs = [{"id": h["id"], "contents": h["contents"]} for h in per_query]
        if return_scores:
            result.append(
                [{"document": d, "score": float(h["score"])} for d, h in zip(docs, per_query, strict=True)]
            )
        else:
            result.append(docs)
    return {"result": result}


def parse_result(payload: Any, n_queries: int) -> Hits:
    """A response body back into hits ``{"id", "contents", "score"}`` (score None without scores);
    ValueError naming what is wrong when it does not have the contract's shape."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise ValueError("response has no 'result' list")
    result = payload["result"]
    if len(result) != n_queries:
        raise ValueError(f"response has {len(result)} result lists for {n_queries} queries")
    return [_hits(per_query, i) for i, per_query in enumerate(result)]


def _hits(items: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(items, list):
        raise ValueError(f"result[{i}] is not a list")
    out = []
    for j, item in enumerate(items):
        doc, score = (item.get("document"), item.get("score")) if _is_scored(item) else (item, None)
        ok_doc = isinstance(doc, dict) and isinstance(doc.get("contents"), str) and "id" in doc
        ok_score = score is None or (_is_number(score) and math.isfinite(score))
        if not (ok_doc and ok_score):
            raise ValueError(f"result[{i}][{j}] is not a document with 'id' and 'contents' (and a score)")
        out.append({"id": str(doc["id"]), "contents": doc["contents"], "score": score})
    return out


def _is_scored(item: Any) -> bool:
    return isinstance(item, dict) and "document" in item


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def chunks(queries: Sequence[str], size: int) -> list[list[str]]:
    """``queries`` in request-sized batches, order kept."""
    return [list(queries[i : i + size]) for i in range(0, len(queries), size)]
