"""The viewer's HTTP server: FastAPI on uvicorn, the stack of the external-agent endpoint
(actors/external/endpoint.py), serving one page and its JSON.

    server = ViewServer(app_state, host="127.0.0.1", port=0, token=None)   # binds now: a taken port fails
    server.url            # what to open (with ?token=... when there is one)
    server.serve()        # blocks (the CLI); or server.start() / server.close() around a thread

Routes: `GET /` the page, `GET /static/<file>`, `GET /api/run`, `GET /api/trees?offset&limit&sort&desc
&no_signal&truncated&credited&mismatch_min&q`, `GET /api/tree/<id>`. Errors are `{"error": one line}`.

Auth, as the endpoint's: loopback by default; any other bind address needs a token (`--token` or
`$TREEOPSD_VIEW_TOKEN`), and with a token every request must carry it: `Authorization: Bearer <token>`, or
the cookie that opening `/?token=<token>` sets (a browser cannot send a header on navigation), compared in
constant time, else 401. On loopback, a request whose Host header names another host is refused (403), so
a page elsewhere cannot reach the server through DNS rebinding. The page loads nothing from elsewhere
(Content-Security-Policy: default-src 'self').
"""

from __future__ import annotations

import hmac
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from configs.schema import is_loopback

TOKEN_ENV = "TREEOPSD_VIEW_TOKEN"
COOKIE = "treeopsd_view"
STATIC = Path(__file__).with_name("static")
STATIC_FILES = {"index.html", "view.js", "tree.js", "view.css"}
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; object-src 'none'"
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "[::1]", "::1"}

Handlers = dict[str, Callable[..., Any]]


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or OSError naming the address (a port in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(128)  # connections wait in the backlog until uvicorn accepts: the URL works once printed
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from exc
    return sock


class ViewServer:
    def __init__(self, handlers: Handlers, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        token = token or os.environ.get(TOKEN_ENV) or None
        if not is_loopback(host) and not token:
            raise PermissionError(f"--host {host} is not loopback: it needs --token or ${TOKEN_ENV}")
        self.host, self.token = host, token
        self.sock = bind(host, port)
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(
            build_app(handlers, self), log_level="warning", lifespan="off", access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host.strip('[]')}]" if ":" in self.host else self.host
        base = f"http://{host}:{self.port}/"
        return f"{base}?token={self.token}" if self.token else base

    def serve(self) -> None:
        self._server.run(sockets=[self.sock])

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve, name="treeopsd-view", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the view server did not start on {self.host}:{self.port}")

    def close(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sock.close()

    def allowed(self, request: Request) -> int:
        """0 when the request may pass, else the HTTP status that refuses it."""
        if is_loopback(self.host) and host_name(request.headers.get("host", "")) not in LOOPBACK_NAMES:
            return 403
        if self.token is None:
            return 0
        sent = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        sent = sent or request.cookies.get(COOKIE, "") or request.query_params.get("token", "")
        return 0 if hmac.compare_digest(sent.encode(), self.token.encode()) else 401


def host_name(header: str) -> str:
    """The host of a Host header without its port: `[::1]:80` → `[::1]`, `localhost:80` → `localhost`."""
    if header.startswith("["):
        return header.split("]")[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def build_app(handlers: Handlers, server: ViewServer) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[..., Any]) -> Response:
        status = server.allowed(request)
        if status:
            text = "missing or wrong token" if status == 401 else "Host header names another host"
            return _error(status, text)
        response: Response = await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Cache-Control"] = "no-store"
        if server.token and request.query_params.get("token"):
            response.set_cookie(COOKIE, server.token, httponly=True, samesite="strict")
        return response

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/{name}")
    def static(name: str) -> Response:
        if name not in STATIC_FILES:
            return _error(404, f"no static file {name!r}")
        return FileResponse(STATIC / name)

    @app.get("/api/run")
    def run_info() -> JSONResponse:
        return JSONResponse(handlers["run"]())

    @app.get("/api/trees")
    def trees(request: Request) -> JSONResponse:
        try:
            return JSONResponse(handlers["trees"](dict(request.query_params)))
        except ValueError as e:
            return _error(400, str(e))

    @app.get("/api/tree/{tree_id:path}")  # a tree id may hold a slash
    def tree(tree_id: str) -> Response:
        return Response(handlers["tree"](tree_id), media_type="application/json")

    return app
