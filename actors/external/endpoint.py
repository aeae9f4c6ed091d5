"""The HTTP side of the external-agent endpoint: an OpenAI-compatible server in front of the sampler.

    ep = AgentEndpoint(host="127.0.0.1", port=0, token=None)     # binds now (a taken port fails here)
    ep.url                                                      # http://127.0.0.1:PORT/v1 for the client
    ep.attach(rnd, loop)   ...   ep.detach()                     # a sampling round's sessions (session.py)
    ep.close()

Routes: `POST /v1/chat/completions`, `POST /v1/reward` ({"reward": r}), `GET /v1/models`, `GET /health`.
A request names its session by the `X-Session-Id` header or the `user` field. Errors are OpenAI's JSON
(`{"error": {"message", "type", ...}}`), one line naming the problem: malformed JSON 400, no session 400,
unknown session 404, a refused conversation 409, a finished one 410.

Threads: uvicorn runs in its own thread with its own event loop for the endpoint's lifetime; it is transport
only. Each request is handed to the sampling round's loop (`asyncio.run_coroutine_threadsafe`), where every
session is read and written — the loop the turn server and the weight gate live on (asyncio.run in the
sampler, or vLLM's engine loop) — so the sessions need no locks. Between rounds no session exists: 404.

Auth: loopback by default. Any other bind address requires a token (`env.agent_token` or
`$TREEOPSD_AGENT_TOKEN`); with a token every request must send `Authorization: Bearer <token>` (the openai
client's `api_key`), compared in constant time, else 401.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from actors.external.openai_format import ApiError
from actors.external.session import Round
from configs.schema import is_loopback

TOKEN_ENV = "TREEOPSD_AGENT_TOKEN"
MAX_BODY = 16 << 20
log = logging.getLogger(__name__)
_Call = Callable[[Round], Coroutine[Any, Any, tuple[int, dict[str, Any]]]]


def resolve_token(token: str | None) -> str | None:
    """An explicit token, else `$TREEOPSD_AGENT_TOKEN`, else None."""
    return token or os.environ.get(TOKEN_ENV) or None


class AgentEndpoint:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, token: str | None = None, wait_s: float = 600.0
    ) -> None:
        token = resolve_token(token)
        if not is_loopback(host) and not token:
            raise PermissionError(
                f"env.agent_host = {host} (not loopback) needs env.agent_token or ${TOKEN_ENV}"
            )
        self.host, self.token, self.wait_s = host, token, wait_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host.strip("[]"), port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"env.agent_port = {port}: cannot bind {host}:{port}: {exc}") from exc
        self.port = int(self.sock.getsockname()[1])
        self.rejected = 0  # requests refused before reaching a session (auth, malformed JSON, no session id)
        self._round: Round | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        config = uvicorn.Config(build_app(self), log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)  # in its own thread: no signal handlers
        self._thread = threading.Thread(target=self._serve, name="agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the agent endpoint did not start on {host}:{self.port}")

    def _serve(self) -> None:
        self._server.run(sockets=[self.sock])

    @property
    def url(self) -> str:
        host = f"[{self.host.strip('[]')}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def attach(self, rnd: Round, loop: asyncio.AbstractEventLoop) -> None:
        self._round, self._loop = rnd, loop

    def detach(self) -> None:
        self._round = self._loop = None

    def authorized(self, header: str) -> bool:
        if self.token is None:
            return True
        return hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode())

    async def forward(self, call: _Call) -> tuple[int, dict[str, Any]]:
        """Runs `call(round)` on the sampling loop and waits for its answer (404 between rounds)."""
        rnd, loop = self._round, self._loop
        if rnd is None or loop is None or loop.is_closed():
            return 404, ApiError(
                404, "no sampling round is running: no session exists", "not_found_error"
            ).payload()
        try:
            fut = asyncio.run_coroutine_threadsafe(call(rnd), loop)
        except RuntimeError:  # the loop closed meanwhile
            return 404, ApiError(404, "the sampling round is over", "not_found_error").payload()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.wait_s)
        except TimeoutError:
            fut.cancel()
            return 503, ApiError(503, "the sampler did not answer in time", "server_error").payload()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.sock.close()


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(ApiError(status, message, kind).payload(), status_code=status)


async def read_json(request: Request) -> Any:
    """The body as JSON, or an ApiError (400 malformed, 413 too large)."""
    size = request.headers.get("content-length", "0")
    if size.isdigit() and int(size) > MAX_BODY:
        raise ApiError(413, f"the request body exceeds {MAX_BODY} bytes")
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise ApiError(413, f"the request body exceeds {MAX_BODY} bytes")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def session_of(request: Request, body: Any) -> str:
    sid = request.headers.get("x-session-id") or (body.get("user") if isinstance(body, dict) else None)
    if not isinstance(sid, str) or not sid:
        raise ApiError(400, "no session: send the X-Session-Id header or the user field", param="user")
    return sid


def unauthorized(ep: AgentEndpoint) -> JSONResponse:
    ep.rejected += 1
    return error(401, "missing or wrong token (send Authorization: Bearer <token>)", "authentication_error")


def build_app(ep: AgentEndpoint) -> FastAPI:
    app = FastAPI(title="treeopsd agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    async def routed(request: Request, call: Callable[[str, Any], _Call]) -> JSONResponse:
        if not ep.authorized(request.headers.get("authorization", "")):
            return unauthorized(ep)
        try:
            body = await read_json(request)
            sid = session_of(request, body)
        except ApiError as exc:
            ep.rejected += 1
            return JSONResponse(exc.payload(), status_code=exc.status)
        status, payload = await ep.forward(call(sid, body))
        # a refused or finished session stays so, a failed sampler fails its round: OpenAI clients would
        # retry a 409 or a 500 otherwise
        headers = {"x-should-retry": "false"} if status in (409, 410, 500) else None
        return JSONResponse(payload, status_code=status, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        return await routed(request, lambda sid, body: lambda rnd: rnd.chat(sid, body))

    @app.post("/v1/reward")
    async def reward(request: Request) -> JSONResponse:
        return await routed(request, lambda sid, body: lambda rnd: rnd.reward(sid, body))

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        if not ep.authorized(request.headers.get("authorization", "")):
            return unauthorized(ep)
        return JSONResponse(
            {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "treeopsd"}]}
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": True})

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return error(404, f"unknown path {request.url.path}; use POST /v1/chat/completions or /v1/reward")

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return error(405, f"{request.method} is not allowed on {request.url.path}")

    return app
