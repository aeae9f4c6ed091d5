"""The agent endpoint's routes (endpoint.py has the server, keys.py who may call what):

    app = build_app(endpoint)

Session routes (the session's own key, or the bearer token with the session named by `X-Session-Id` or the
URL): `POST /v1/chat/completions`, `POST /v1/reward`, `POST /v1/tools/call`, `POST /v1/tasks/done`, and the
same under `/s/<session>/v1` (with `GET /s/<session>/v1/models`). Global routes (the bearer token only):
`GET /v1/tasks/next`, `GET /v1/models`; and `GET /health` (open). A body is read chunk by chunk and refused
with a 413 as soon as it passes `MAX_BODY` (a chunked body too, before it is buffered whole); JSON is decoded
in a worker thread. Every 4xx is counted by reason and logged once (`AgentEndpoint.refusals`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from actors.external.health import Refusals
from actors.external.keys import Keys, unauthorized
from actors.external.openai_format import ApiError
from actors.external.remote import TaskQueue
from actors.external.session import Round
from actors.external.streaming import sse_events
from actors.external.turns import chat as chat_request

MAX_BODY = 16 << 20
INLINE_JSON = 1 << 16  # bodies up to this size are decoded on the endpoint's loop, larger ones in a thread
_Call = Callable[[Round], Coroutine[Any, Any, tuple[int, dict[str, Any]]]]
SESSION_NEEDED = "this route needs the session's api key (task['api_key']), or the bearer token"


class AgentEndpoint(Protocol):
    """What the routes use of the endpoint (endpoint.py)."""

    keys: Keys
    refusals: Refusals
    tasks: TaskQueue
    rejected: int

    async def forward(self, call: _Call) -> tuple[int, dict[str, Any]]: ...


def reply(
    ep: AgentEndpoint, status: int, payload: dict[str, Any], session: str | None = None, **kw: Any
) -> JSONResponse:
    """The JSON response; a 4xx is counted by reason and logged (`ep.refusals`)."""
    if 400 <= status < 500:
        ep.refusals.record(status, payload, session)
    return JSONResponse(payload, status_code=status, **kw)


def refused(ep: AgentEndpoint, exc: ApiError, session: str | None = None) -> JSONResponse:
    return reply(ep, exc.status, exc.payload(), session)


async def read_body(request: Request) -> bytes:
    """The body, refused with a 413 as soon as its declared or received size passes MAX_BODY."""
    declared = request.headers.get("content-length", "")
    too_large = f"the request body exceeds {MAX_BODY} bytes"
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise ApiError(413, too_large, "request_too_large")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"{too_large} (refused while reading it)", "request_too_large")
        parts.append(chunk)
    return b"".join(parts)


async def read_json(request: Request) -> Any:
    raw = await read_body(request)
    try:
        return json.loads(raw) if len(raw) <= INLINE_JSON else await asyncio.to_thread(json.loads, raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def named_session(request: Request, keyed: str | None) -> str:
    """The request's session: its key's, its URL's (`/s/<session>/v1/...`) or its `X-Session-Id` header's;
    two of them naming different sessions is a 400."""
    sources = (
        ("the URL", request.path_params.get("session")),
        ("the api key", keyed),
        ("the X-Session-Id header", request.headers.get("x-session-id") or None),
    )
    named = [(where, v) for where, v in sources if v is not None]
    if not named:
        why = "no session: use the task's session_url or api_key, or send the X-Session-Id header"
        raise ApiError(400, why, param="session")
    for where, v in named[1:]:
        if v != named[0][1]:
            why = f"{named[0][0]} names session {named[0][1]!r}, {where} {v!r}"
            raise ApiError(400, f"two sessions named: {why}", param="session")
    return str(named[0][1])


async def identify(ep: AgentEndpoint, request: Request, body: bool = True) -> tuple[str, Any] | Response:
    """(session, body) of a session route's request, or the refusal: 401 (no key, a forged or unknown key),
    410 (its episode ended), 400/413 (body, session)."""
    auth = request.headers.get("authorization", "")
    try:
        keyed = ep.keys.session_of(auth)  # a per-session key: authenticates and names its session
        if keyed is None and not ep.keys.is_operator_token(auth):
            raise unauthorized(SESSION_NEEDED)
        sid = named_session(request, keyed)
        got = await read_json(request) if body else None
    except ApiError as exc:
        ep.rejected += 1
        return refused(ep, exc)
    ep.tasks.seen()
    return sid, got


def global_refusal(ep: AgentEndpoint, request: Request) -> Response | None:
    """A global route's check: the bearer token only (a session's key is a 401 here)."""
    auth = request.headers.get("authorization", "")
    if ep.keys.operator(auth):
        return None
    ep.rejected += 1
    if auth.startswith("Bearer tsd."):
        return refused(ep, unauthorized("a session's api key opens its own session's routes only"))
    return refused(ep, unauthorized("missing or wrong token (send Authorization: Bearer <token>)"))


def add_task_routes(app: FastAPI, ep: AgentEndpoint) -> None:
    """The routes of agents in a process of their own (remote.py): served here, not by the round."""

    async def local(request: Request, call: Callable[[str, Any], dict[str, Any]]) -> Response:
        got = await identify(ep, request)
        if isinstance(got, Response):
            return got
        try:
            return JSONResponse(await asyncio.to_thread(call, *got))  # a tool may take a while
        except ApiError as exc:
            return refused(ep, exc, got[0])

    @app.get("/v1/tasks/next")
    async def next_task(request: Request) -> Response:
        refusal = global_refusal(ep, request)
        if refusal is not None:
            return refusal
        ep.tasks.seen()
        return JSONResponse({"task": ep.tasks.take()})

    @app.post("/v1/tools/call")
    @app.post("/s/{session:path}/v1/tools/call")
    async def tools(request: Request) -> Response:
        return await local(request, ep.tasks.call_tool)

    @app.post("/v1/tasks/done")
    @app.post("/s/{session:path}/v1/tasks/done")
    async def done(request: Request) -> Response:
        return await local(request, lambda sid, _: {"session": sid, "finished": ep.tasks.finish(sid)})


def add_model_routes(app: FastAPI, ep: AgentEndpoint) -> None:
    models = {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "treeopsd"}]}

    @app.get("/v1/models")
    async def all_models(request: Request) -> Response:
        return global_refusal(ep, request) or JSONResponse(models)

    @app.get("/s/{session:path}/v1/models")
    async def session_models(request: Request) -> Response:
        got = await identify(ep, request, body=False)
        return got if isinstance(got, Response) else JSONResponse(models)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": True})


def build_app(ep: AgentEndpoint) -> FastAPI:
    app = FastAPI(title="treeopsd agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    add_task_routes(app, ep)
    add_model_routes(app, ep)

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
        return reply(ep, status, payload, sid, headers=headers)

    @app.post("/v1/chat/completions")
    @app.post("/s/{session:path}/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await routed(request, lambda sid, body: lambda rnd: chat_request(rnd, sid, body))

    @app.post("/v1/reward")
    @app.post("/s/{session:path}/v1/reward")
    async def reward(request: Request) -> Response:
        return await routed(request, lambda sid, body: lambda rnd: rnd.reward(sid, body), reward=True)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        why = f"unknown path {request.url.path}; use POST /v1/chat/completions or /v1/reward"
        return refused(ep, ApiError(404, why, "not_found_error"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return refused(ep, ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    return app
