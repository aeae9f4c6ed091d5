"""The retrieval service: Search-R1's ``POST /retrieve`` over any index with ``search(queries, topk)``.

    server = RetrievalServer(index, host="127.0.0.1", port=0, token=None)
    server.start()                         # a background thread (a Ray actor, a test), or
    server.serve_forever()                 # the foreground (`treeopsd retrieve serve`)
    server.url                             # http://127.0.0.1:PORT ; POST {url}/retrieve, GET {url}/health
    server.stop()

The standard library's ``ThreadingHTTPServer`` (a thread per connection): the work is a CPU-bound search
that holds the GIL either way, so an event loop would add a dependency and nothing else; it starts and stops
synchronously in any thread (a Ray actor's, a test's), and a port in use is an ``OSError`` at construction.

Auth: loopback by default. Any other bind address requires a token (``TREEOPSD_RETRIEVER_TOKEN`` or an
explicit one); with a token every request must carry ``Authorization: Bearer <token>`` (constant-time
compare), else 401. Request bodies over ``MAX_BODY`` bytes get 413, a bad request 400 naming the field
(``actors/envs/retrieval.py``), an index that raises 500.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from actors.envs.retrieval import RequestError, format_result, parse_request
from configs.schema import is_loopback

TOKEN_ENV = "TREEOPSD_RETRIEVER_TOKEN"
MAX_BODY = 16 << 20
log = logging.getLogger(__name__)


def resolve_token(token: str | None) -> str | None:
    """An explicit token, else ``$TREEOPSD_RETRIEVER_TOKEN``, else None."""
    return token or os.environ.get(TOKEN_ENV) or None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # a restarted service rebinds its port despite TIME_WAIT sockets


class _Server6(_Server):
    address_family = socket.AF_INET6


class RetrievalServer:
    """One HTTP server over ``index``; ``token`` None: no auth (allowed on loopback only)."""

    def __init__(self, index: Any, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        if not is_loopback(host) and not token:
            raise PermissionError(f"binding {host} (not loopback) needs a token: --token or ${TOKEN_ENV}")
        self._handler = type("Handler", (_Handler,), {"index": index, "token": token})
        cls = _Server6 if ":" in host else _Server
        self.httpd = cls((host.strip("[]"), port), self._handler)  # OSError when the port is taken
        self.host, self.port = host, int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def index(self) -> Any:
        return self._handler.index

    @index.setter
    def index(self, index: Any) -> None:
        """Bind first (a taken port fails at once), build or load the index, then set it; until then 503."""
        self._handler.index = index

    @property
    def url(self) -> str:
        host = f"[{self.host.strip('[]')}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> RetrievalServer:
        self._thread = threading.Thread(target=self.serve_forever, name="retrieval-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.1)

    def stop(self) -> None:
        """Stops serving and closes the socket: later connections are refused."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for clients that reuse connections
    server_version = "treeopsd-retrieval/1"
    index: Any = None
    token: str | None = None

    def do_POST(self) -> None:
        if not self._authorized():
            return
        if self.path.split("?")[0] != "/retrieve":
            self._send(404, {"error": f"unknown path {self.path}; use POST /retrieve"}, close=True)
            return
        body = self._body()
        if body is None:
            return
        if self.index is None:
            self._send(503, {"error": "the index is still loading"})
            return
        try:
            req = parse_request(body)
        except RequestError as exc:
            self._send(400, exc.payload())
            return
        try:
            hits = self.index.search(req.queries, req.topk)
        except Exception as exc:  # the index failed: the client sees a 5xx and may retry
            log.exception("search failed")
            self._send(500, {"error": f"search failed: {type(exc).__name__}: {exc}"})
            return
        self._send(200, format_result(hits, req.return_scores))

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path.split("?")[0] != "/health":
            self._send(404, {"error": f"unknown path {self.path}; use POST /retrieve or GET /health"})
            return
        ready = self.index is not None
        passages = len(self.index) if ready else 0
        self._send(
            200, {"ok": ready, "passages": passages, "index": type(self.index).__name__ if ready else None}
        )

    def _authorized(self) -> bool:
        if self.token is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return True
        self._send(401, {"error": "missing or wrong token (send Authorization: Bearer <token>)"}, close=True)
        return False

    def _body(self) -> bytes | None:
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.strip().isdigit():
            self._send(
                400, {"error": "Content-Length: missing or not a number", "field": "Content-Length"}, True
            )
            return None
        n = int(raw)
        if n > MAX_BODY:
            self._send(413, {"error": f"body of {n} bytes is over the {MAX_BODY}-byte limit"}, close=True)
            return None
        return self.rfile.read(n)

    def _send(self, status: int, payload: dict[str, Any], close: bool = False) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if close:  # the request body was not read: the connection cannot carry another request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)
