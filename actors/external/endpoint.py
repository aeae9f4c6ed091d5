"""The HTTP side of the external-agent endpoint: an OpenAI-compatible server in front of the sampler.

    ep = AgentEndpoint(host="127.0.0.1", port=0, token=None)     # binds now (a taken port fails here)
    ep.url                                                      # http://127.0.0.1:PORT/v1 for the client
    ep.attach(rnd, loop)   ...   ep.detach()                     # a sampling round's sessions (session.py)
    ep.close()

Routes (routes.py): `POST /v1/chat/completions`, `POST /v1/reward` ({"reward": r}), `GET /v1/models`,
`GET /health`; for agents in a process of their own (remote.py): `GET /v1/tasks/next`, `POST /v1/tools/call`,
`POST /v1/tasks/done`. A request names its session by its api key, by the `X-Session-Id` header or by its
URL: the same routes under `/s/<session>/v1` (`ep.session_url(key)`); the `user` field is accepted and
ignored. Errors are OpenAI's JSON (`{"error": {"message", "type", ...}}`), one line naming the problem; every
4xx is counted by reason and logged (health.py `Refusals`).

Threads: uvicorn runs in its own thread with its own event loop for the endpoint's lifetime; it is transport
only (a body is read with its size capped as it arrives, and decoded in a worker thread). Each request is
handed to the sampling round's loop (`asyncio.run_coroutine_threadsafe`), where every session is read and
written — the loop the turn server and the weight gate live on (asyncio.run in the sampler, or vLLM's engine
loop) — so the sessions need no locks; what is slow there (parsing, rendering, tokenizing) runs in worker
threads (turns.py). Between rounds no session exists: 404.

Auth (keys.py): loopback by default. Any other bind address requires a token (`env.agent_token` or
`$TREEOPSD_AGENT_TOKEN`). The global routes (`/v1/tasks/next`, `/v1/models`) take the bearer token only; a
session's routes take that session's own key (`ep.session_key(session)`, the harness's `task["api_key"]`:
an HMAC of the session, so an unmodified client with `base_url` and that key needs nothing else), with or
without a token, or the bearer token with the session named by header or URL. A key opens its session while
the episode runs (`ep.opened`, `ep.ended`): then 410; a forged key 401. The configuration refuses a
non-loopback `env.agent_host` without a token at load (configs/schema.py); the check here guards direct use.

Logs: httpx (and the openai client's httpx2) logs every request at INFO ("HTTP Request: POST ..."); the
harness's requests to a live endpoint are demoted to DEBUG (`_QuietRequests`); other requests keep theirs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import quote

import uvicorn

from actors.external.health import Refusals
from actors.external.keys import Keys
from actors.external.openai_format import ApiError
from actors.external.remote import QUEUES, TaskQueue
from actors.external.routes import build_app
from actors.external.session import Round
from configs.schema import AGENT_TOKEN_ENV as TOKEN_ENV
from configs.schema import is_loopback

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
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        wait_s: float = 600.0,
        agent_wait_s: float = 10.0,
    ) -> None:
        token = resolve_token(token)
        if not is_loopback(host) and not token:
            raise PermissionError(
                f"env.agent_host = {host} (not loopback) needs env.agent_token or ${TOKEN_ENV}"
            )
        self.host, self.token, self.wait_s = host, token, wait_s
        self.keys = Keys(token)  # the bearer token and the per-session keys (keys.py)
        self.refusals = Refusals()  # every 4xx, counted by reason and logged (health.py)
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
        # for agents elsewhere (remote.py)
        self.tasks = QUEUES[self.url] = TaskQueue(self.url, wait_s, agent_wait_s)

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
        """The api key that names session `key` by itself and opens its routes while its episode runs
        (keys.py): `tsd.<session, base64url>.<HMAC-SHA256 of the session>`; not guessable from the session."""
        return self.keys.issue(key)

    def keyed_session(self, header: str) -> str | None:
        """The session a well-signed per-session key names (None: no such key); a forged one: ApiError 401."""
        return self.keys.signed(header)

    def opened(self, key: str) -> None:
        """Session `key`'s episode runs: its key opens its routes."""
        self.keys.opened(key)

    def ended(self, key: str) -> None:
        """Session `key`'s episode is over: its key expires."""
        self.keys.ended(key)

    def attach(self, rnd: Round, loop: asyncio.AbstractEventLoop) -> None:
        self._round, self._loop = rnd, loop

    def detach(self) -> None:
        self._round = self._loop = None

    def metrics(self) -> dict[str, float]:
        """Its own counters, since it started: requests refused before any session, refusals by reason."""
        return {"external/rejected_requests": float(self.rejected), **self.refusals.metrics()}

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
