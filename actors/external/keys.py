"""Who may call what on the agent endpoint: the bearer token and the per-session keys.

    keys = Keys(token)                    # env.agent_token (None: loopback without one)
    key = keys.issue("x0/m0")             # `tsd.<session, base64url>.<HMAC-SHA256 of it>`: task["api_key"]
    keys.opened("x0/m0") ... keys.ended("x0/m0")   # a key opens its session while its episode runs
    keys.session_of(header)               # the session a live key names (None: no session key); ApiError
    keys.operator(header)                 # the bearer token (any header but a session key without one)

A session key is an HMAC of the session under the token (else under a random secret of the endpoint), so it
cannot be guessed from the session id and authenticates that session only: the session's routes
(`/v1/chat/completions`, `/v1/reward`, `/v1/tools/call`, `/v1/tasks/done`, and the same under
`/s/<session>/v1`), never the global ones (`/v1/tasks/next`, `/v1/models`), which take the bearer token only.
The session routes require it also without a token (an `X-Session-Id` header alone opens nothing); with a
token, the token and a session named by header or URL work too (the operator). A key expires when its
episode ends: 410 for a session that ended, 401 for one never opened or forged. Thread-safe: the endpoint's
thread checks keys, the sampling loop opens and ends sessions.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict

from actors.external.openai_format import ApiError

REMEMBERED = 100_000  # ended sessions remembered (a 410 rather than a 401 for their keys)


def unauthorized(why: str) -> ApiError:
    return ApiError(401, why, "authentication_error")


class Keys:
    def __init__(self, token: str | None) -> None:
        self.token = token
        self._secret = token.encode() if token else secrets.token_bytes(32)
        self._mu = threading.Lock()
        self._live: set[str] = set()
        self._ended: OrderedDict[str, None] = OrderedDict()

    def issue(self, session: str) -> str:
        name = base64.urlsafe_b64encode(session.encode()).decode().rstrip("=")
        return f"tsd.{name}.{self._sign(session)}"

    def _sign(self, session: str) -> str:
        return hmac.new(self._secret, session.encode(), hashlib.sha256).hexdigest()

    def opened(self, session: str) -> None:
        with self._mu:
            self._live.add(session)
            self._ended.pop(session, None)

    def ended(self, session: str) -> None:
        with self._mu:
            self._live.discard(session)
            self._ended[session] = None
            while len(self._ended) > REMEMBERED:
                self._ended.popitem(last=False)

    def signed(self, header: str) -> str | None:
        """The session a well-signed key names, live or not (None: the header holds no session key); a key
        whose signature is wrong is a 401."""
        parts = header.removeprefix("Bearer ").strip().split(".")
        if not header.startswith("Bearer tsd.") or len(parts) != 3:
            return None
        try:
            session = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError):
            session = ""
        if not session or not hmac.compare_digest(parts[2].encode(), self._sign(session).encode()):
            raise unauthorized("the api key names no session of this endpoint")
        return session

    def session_of(self, header: str) -> str | None:
        """The session a live key names; None: no session key; 401 forged or never opened, 410 ended."""
        session = self.signed(header)
        if session is None:
            return None
        with self._mu:
            live, ended = session in self._live, session in self._ended
        if ended:
            raise ApiError(410, f"session {session!r} is over: its key expired with its episode", "gone")
        if not live:
            raise unauthorized(f"the api key of session {session!r} opens nothing: no such episode runs")
        return session

    def operator(self, header: str) -> bool:
        """The bearer token; without a token set, any header but a session key (loopback)."""
        if header.startswith("Bearer tsd."):
            return False
        if self.token is None:
            return True
        return hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode())

    def is_operator_token(self, header: str) -> bool:
        """The bearer token itself (a token is set and the header carries it)."""
        return self.token is not None and self.operator(header)
