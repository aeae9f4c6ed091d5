"""Helpers for the retrieval-service tests: a wiki-18 style corpus, raw HTTP calls, and misbehaving servers
(scripted answers, a listener that never answers), all on loopback."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from actors.envs.synthetic_kb import generate_kb


def write_corpus(path: Path, n: int | None = None, extra: Sequence[str] = ()) -> Path:
    """The synthetic KB's facts as wiki-18 JSONL (``"Title"\\ntext``), optionally cut to n, plus extras."""
    passages = generate_kb().passages()[:n]
    rows = [{"id": p.id, "contents": f'"Fact {i}"\n{p.text}'} for i, p in enumerate(passages)]
    rows += [{"id": f"extra-{i}", "contents": text} for i, text in enumerate(extra)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def post(url: str, body: bytes | dict, token: str | None = None, path: str = "/retrieve") -> tuple[int, Any]:
    """(status, JSON body) of one POST; HTTP errors are returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class ScriptedServer:
    """Answers POSTs with the next (status, body bytes) of `script` (the last one repeats); counts them."""

    def __init__(self, script: Sequence[tuple[int, bytes]]) -> None:
        self.script, self.calls = list(script), 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, body = outer.script[min(outer.calls, len(outer.script) - 1)]
                outer.calls += 1
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Silent:
    """A loopback listener that accepts connections and never answers (a hung service)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


def good_body(n_queries: int) -> bytes:
    hit = {"document": {"id": "d", "contents": "c"}, "score": 1.0}
    return json.dumps({"result": [[hit]] * n_queries}).encode()
