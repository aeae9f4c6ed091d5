"""The retrieval service's client: a ``Retriever`` (``search(queries, topk)``, like ``Bm25Index``) over HTTP.

    client = RetrievalClient("http://127.0.0.1:8000", token=None, timeout_s=10.0, retries=2)
    client.search(["q1", "q2"], topk=3)     # one POST /retrieve per `max_batch` queries
    client.metrics()                        # {"env/retrieval_errors": failed searches, ...}

Each request has ``timeout_s`` (connect and each read); a failed one is retried up to ``retries`` times,
``backoff_s * 2**attempt`` apart (at most ``max_backoff_s``). Connection refused or reset, timeouts, 5xx,
bodies that are not JSON or not the contract's shape are retried; a 4xx is not (the same request would fail
again). When every try failed, ``search`` counts one retrieval error and raises ``RetrievalError``, a
``ToolError``: the environment turns it into the turn's observation (``error: search failed: ...``) and
the episode goes on (``actors/envs/base.py:ToolEnv.step``). Proxies from the environment are not used.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from actors.envs.base import ToolError
from actors.envs.retrieval import Hits, RetrieveRequest, chunks, parse_result
from actors.envs.retrieval_server import resolve_token
from configs.schema import EnvConfig

ERRORS_METRIC, RETRIES_METRIC = "env/retrieval_errors", "env/retrieval_retries"


class RetrievalError(ToolError):
    """The retrieval service could not answer a search (after the retries)."""


class _Refused(Exception):
    """A 4xx answer: not retried."""


class _BadAnswer(Exception):
    """A 5xx answer, or a body that is not the contract's JSON: retried."""


class RetrievalClient:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        max_batch: int = 256,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or max_batch < 1:
            raise ValueError(
                f"bad client settings: timeout_s={timeout_s}, retries={retries}, max_batch={max_batch}"
            )
        base = url.rstrip("/")
        self.url = base if base.endswith("/retrieve") else base + "/retrieve"
        self.token = resolve_token(token)
        self.timeout_s, self.retries, self.max_batch = timeout_s, retries, max_batch
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.errors = self.retried = 0
        self._lock = threading.Lock()
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def search(self, queries: Sequence[str], topk: int) -> Hits:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        out: Hits = []
        for batch in chunks(queries, self.max_batch):
            out += self._request(batch, topk)
        return out

    def search_one(self, query: str, topk: int) -> list[dict[str, Any]]:
        return self.search([query], topk)[0]

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {ERRORS_METRIC: float(self.errors), RETRIES_METRIC: float(self.retried)}

    def _request(self, queries: list[str], topk: int) -> Hits:
        body = RetrieveRequest(queries, topk, return_scores=True).body()
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.retried += 1
                time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            try:
                return self._answer(body, len(queries))
            except _Refused as exc:
                reason = str(exc)
                break
            except _BadAnswer as exc:
                reason = str(exc)
            except (OSError, http.client.HTTPException) as exc:  # URLError and timeouts are OSErrors
                reason = _describe(exc)
        with self._lock:
            self.errors += 1
        tries = f"{attempt + 1} {'try' if attempt == 0 else 'tries'}"
        raise RetrievalError(f"search failed: the retrieval service at {self.url} {reason} ({tries})")

    def _answer(self, body: bytes, n_queries: int) -> Hits:
        payload = self._post(body)
        try:
            return parse_result(payload, n_queries)
        except ValueError as exc:
            raise _BadAnswer(f"answered malformed JSON: {exc}") from None

    def _post(self, body: bytes) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = _error_detail(exc)
            if 400 <= exc.code < 500:
                raise _Refused(f"answered HTTP {exc.code}: {detail}") from None
            raise _BadAnswer(f"answered HTTP {exc.code}: {detail}") from None
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _BadAnswer(f"answered with a body that is not JSON ({raw[:80]!r})") from None


def _error_detail(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("error", ""))[:200]
    except Exception:
        return exc.reason if isinstance(exc.reason, str) else ""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, TimeoutError):
        return "did not answer in time"
    if isinstance(exc, ConnectionRefusedError):
        return "refused the connection (is it running?)"
    return f"failed: {type(exc).__name__}: {exc}"


def service_client(env: EnvConfig) -> RetrievalClient | None:
    """The client for ``env.retriever = service`` (None for ``local``: the environment's own index)."""
    if env.retriever != "service":
        return None
    if env.retriever_url is None:
        raise ValueError(
            "env.retriever_url is not set: with env.retriever = service only `treeopsd train` starts a "
            "retrieval service itself; start one with `treeopsd retrieve serve` and pass its URL"
        )
    return RetrievalClient(
        env.retriever_url,
        token=env.retriever_token,
        timeout_s=env.retriever_timeout_s,
        retries=env.retriever_retries,
    )
