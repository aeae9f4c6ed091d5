"""The HTTP side of the external-agent endpoint: an OpenAI-compatible server in front of the sampler.

    ep = AgentEndpoint(host="127.0.0.1", port=0, token=None)     # binds now (a taken port fails here)
    ep.url                                                      # http://127.0.0.1:PORT/v1 for the client
    ep.attach(rnd, loop)   ...   ep.detach()                     # a sampling round's sessions (session.py)
    ep.close()

Routes: `POST /v1/chat/completions`, `POST /v1/reward` ({"reward": r}), `GET /v1/models`, `GET /health`;
for agents in a process of their own (remote.py): `GET /v1/tasks/next`, `POST /v1/tools/call`,
`POST /v1/tasks/done`.
A request names its session by its api key (below), by the `X-Session-Id` header or the `user` field, or by
its URL: the same routes under `/s/<session>/v1` (`ep.session_url(key)`), so an unmodified OpenAI client
given that base URL needs no header (two of them naming different sessions: a 400). Errors are OpenAI's JSON
(`{"error": {"message", "type", ...}}`), one line naming the problem: malformed JSON 400, no session 400,
unknown session 404, a refused conversation 409, a finished one 410. With `stream=true` a completion is
sent as server-sent events (streaming.py); an error stays one JSON response.

Threads: uvicorn runs in its own thread with its own event loop for the endpoint's lifetime; it is transport
only. Each request is handed to the sampling round's loop (`asyncio.run_coroutine_threadsafe`), where every
session is read and written — the loop the turn server and the weight gate live on (asyncio.run in the
sampler, or vLLM's engine loop) — so the sessions need no locks. Between rounds no session exists: 404.

Auth: loopback by default. Any other bind address requires a token (`env.agent_token` or
`$TREEOPSD_AGENT_TOKEN`); with a token every request must send `Authorization: Bearer <token>` (the openai
client's `api_key`), compared in constant time, else 401. Or a per-session api key
(`ep.session_key(session)`, the harness's `task["api_key"]`): `tsd.<session>.<HMAC of the session under
the token, else a secret of this endpoint>`; it authenticates and names its session, so an unmodified
client with `base_url=http://HOST:PORT/v1` and that key needs nothing else; a forged one is a 401. The
configuration refuses a non-loopback `env.agent_host` without a token at load (configs/schema.py); the check
here guards direct use.

Logs: httpx (and the openai client's httpx2) logs every request at INFO ("HTTP Request: POST ..."); the
harness's requests to a live endpoint are demoted to DEBUG (`_QuietRequests`); other requests keep theirs.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import quote

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from actors.external.openai_format import ApiError
from actors.external.remote import QUEUES, TaskQueue
from actors.external.session import Round
from actors.external.streaming import sse_events
from configs.schema import AGENT_TOKEN_ENV as TOKEN_ENV
from configs.schema import is_loopback

MAX_BODY = 16 << 20
log = logging.getLogger(__name__)
_Call = Callable[[Round], Coroutine[Any, Any, tuple[int, dict[str, Any]]]]


class _QuietRequests(logging.Filter):
    """On the httpx loggers: their INFO line per request, for a request to a live endpoint, becomes DEBUG."""

    def __init__(self) -> None:
        super().__init__()
        self.prefixes: set[str] = set()  # "http://HOST:PORT/" of each live endpoint

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        url = str(args[1]) if len(args) > 1 and str(record.msg).startswith("HTTP Request") else ""
        if record.levelno != logging.INFO or not any(url.startswith(p) for p in self.prefixes):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_QUIET = _QuietRequests()
for _name in ("httpx", "httpx2"):  # httpx, and the openai client's own copy of it
    logging.getLogger(_name).addFilter(_QUIET)


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
        self._secret = token.encode() if token else secrets.token_bytes(32)  # signs the per-session keys
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
        _QUIET.prefixes.add(self._prefix)
        self.tasks = QUEUES[self.url] = TaskQueue(self.url, wait_s)  # for agents elsewhere (remote.py)

    @property
    def _prefix(self) -> str:
        return self.url.removesuffix("v1")

    def _serve(self) -> None:
        self._server.run(sockets=[self.sock])

    @property
    def url(self) -> str:
        host = f"[{self.host.strip('[]')}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def session_url(self, key: str) -> str:
        """The base URL that names session `key` by itself: `http://HOST:PORT/s/<key>/v1`."""
        return f"{self._prefix}s/{quote(key, safe='')}/v1"

    def session_key(self, key: str) -> str:
        """The api key that names session `key` by itself: `tsd.<session, base64url>.<HMAC-SHA256 of the
        session under env.agent_token (else a secret of this endpoint)>`; not guessable from the session."""
        name = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
        return f"tsd.{name}.{self._sign(key)}"

    def _sign(self, key: str) -> str:
        return hmac.new(self._secret, key.encode(), hashlib.sha256).hexdigest()

    def keyed_session(self, header: str) -> str | None:
        """The session a per-session api key names (None: no such key); a key whose signature is wrong is
        an ApiError (401)."""
        parts = header.removeprefix("Bearer ").strip().split(".")
        if not header.startswith("Bearer tsd.") or len(parts) != 3:
            return None
        try:
            key = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError):
            key = ""
        if not key or not hmac.compare_digest(parts[2].encode(), self._sign(key).encode()):
            raise ApiError(401, "the api key names no session of this endpoint", "authentication_error")
        return key

    def attach(self, rnd: Round, loop: asyncio.AbstractEventLoop) -> None:
        self._round, self._loop = rnd, loop

    def detach(self) -> None:
        self._round = self._loop = None

    def authorized(self, header: str) -> bool:
        """The bearer token (any header without one set), or a per-session api key."""
        try:
            if self.keyed_session(header) is not None:
                return True
        except ApiError:
            return False
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
        _QUIET.prefixes.discard(self._prefix)
        QUEUES.pop(self.url, None)
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


def session_of(request: Request, body: Any, in_url: str | None = None, in_key: str | None = None) -> str:
    """The request's session: from its URL (`/s/<session>/v1/...`), its per-session api key, the header or
    `user`; two of them naming different sessions is a 400."""
    sid = request.headers.get("x-session-id") or (body.get("user") if isinstance(body, dict) else None)
    sid = sid if isinstance(sid, str) and sid else None
    sources = (("the URL", in_url), ("the api key", in_key), ("the X-Session-Id header or user field", sid))
    named = [(where, v) for where, v in sources if v is not None]
    if not named:
        why = "no session: use the task's session_url or api_key, or send the X-Session-Id header"
        raise ApiError(400, why, param="user")
    for where, v in named[1:]:
        if v != named[0][1]:
            why = f"{named[0][0]} names session {named[0][1]!r}, {where} {v!r}"
            raise ApiError(400, f"two sessions named: {why}", param="user")
    return named[0][1]


def unauthorized(ep: AgentEndpoint) -> JSONResponse:
    ep.rejected += 1
    return error(401, "missing or wrong token (send Authorization: Bearer <token>)", "authentication_error")


async def identify(ep: AgentEndpoint, request: Request) -> tuple[str, Any] | Response:
    """(session, body), or the refusal: 401 (token, forged key), 400/413 (body, session)."""
    auth = request.headers.get("authorization", "")
    try:
        keyed = ep.keyed_session(auth)  # a per-session api key: authenticates and names the session
        if keyed is None and not ep.authorized(auth):
            return unauthorized(ep)
        body = await read_json(request)
        return session_of(request, body, request.path_params.get("session"), keyed), body
    except ApiError as exc:
        ep.rejected += 1
        return JSONResponse(exc.payload(), status_code=exc.status)


def add_task_routes(app: FastAPI, ep: AgentEndpoint) -> None:
    """The routes of agents in a process of their own (remote.py): served here, not by the round."""

    async def local(request: Request, call: Callable[[str, Any], dict[str, Any]]) -> Response:
        got = await identify(ep, request)
        if isinstance(got, Response):
            return got
        try:
            return JSONResponse(await asyncio.to_thread(call, *got))  # a tool may take a while
        except ApiError as exc:
            return JSONResponse(exc.payload(), status_code=exc.status)

    @app.get("/v1/tasks/next")
    async def next_task(request: Request) -> JSONResponse:
        if not ep.authorized(request.headers.get("authorization", "")):
            return unauthorized(ep)
        return JSONResponse({"task": ep.tasks.take()})

    @app.post("/v1/tools/call")
    @app.post("/s/{session:path}/v1/tools/call")
    async def tools(request: Request) -> Response:
        return await local(request, ep.tasks.call_tool)

    @app.post("/v1/tasks/done")
    @app.post("/s/{session:path}/v1/tasks/done")
    async def done(request: Request) -> Response:
        return await local(request, lambda sid, _: {"session": sid, "finished": ep.tasks.finish(sid)})


def build_app(ep: AgentEndpoint) -> FastAPI:
    app = FastAPI(title="treeopsd agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    add_task_routes(app, ep)

    async def routed(request: Request, call: Callable[[str, Any], _Call], reward: bool = False) -> Response:
        got = await identify(ep, request)
        if isinstance(got, Response):
            return got
        sid, body = got
        status, payload = await ep.forward(call(sid, body))
        if reward and status == 200:  # the episode of an agent elsewhere is finished (remote.py)
            ep.tasks.finish(sid)
        # a refused or finished session stays so, a failed sampler fails its round: OpenAI clients would
        # retry a 409 or a 500 otherwise
        headers = {"x-should-retry": "false"} if status in (409, 410, 500) else None
        if status == 200 and "choices" in payload and body.get("stream") is True:  # stream=true: as SSE
            usage = (body.get("stream_options") or {}).get("include_usage") is True
            return StreamingResponse(sse_events(payload, usage), media_type="text/event-stream")
        return JSONResponse(payload, status_code=status, headers=headers)

    @app.post("/v1/chat/completions")
    @app.post("/s/{session:path}/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await routed(request, lambda sid, body: lambda rnd: rnd.chat(sid, body))

    @app.post("/v1/reward")
    @app.post("/s/{session:path}/v1/reward")
    async def reward(request: Request) -> Response:
        return await routed(request, lambda sid, body: lambda rnd: rnd.reward(sid, body), reward=True)

    @app.get("/v1/models")
    @app.get("/s/{session:path}/v1/models")
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
