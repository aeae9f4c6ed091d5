"""A harness's record across sampling rounds: failed episodes in a row (a bound stops the run) and the
drop warnings, rate-limited; and the endpoint's refusals (every 4xx), counted by reason (`Refusals`).

    health = HarnessHealth("examples.search_agent:run_episode", max_failures=32)
    stop = health.episode_done(session)      # after each episode: None, or the failure that stops the run

Only trunks count toward the streak (a branch refused as non-deterministic is counted elsewhere, and its
tree still stores its trunks); a stored trunk resets it. `env.harness_max_failures` trunks in a row
dropped, whatever the reason (the harness raised, hung, gave no reward, its prompt did not fit), end the
run with one line naming the harness and the last reason: a SamplerConfigFailure on `env.harness`, which
the driver reports and stops on instead of restarting the sampler into the same failure.

Warnings: the first drop is logged at WARNING, then at most one line per `report_every_s` with how many
were dropped since; every drop is logged at DEBUG and counted (`external/*`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from actors.external.session import Session
from actors.failures import SamplerConfigFailure

log = logging.getLogger(__name__)


def brief(text: str, limit: int = 300) -> str:
    """One line, at most `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class HarnessHealth:
    def __init__(self, name: str, max_failures: int = 32, report_every_s: float = 60.0) -> None:
        self.name, self.max_failures, self.report_every_s = name, max_failures, report_every_s
        self.in_row = 0  # trunks dropped in a row (across rounds)
        self.unreported = 0  # drops since the last warning
        self.reported_at = -float("inf")

    def episode_done(self, s: Session) -> SamplerConfigFailure | None:
        """Records one finished episode; the failure that stops the run when the streak reaches its bound."""
        if s.failure is not None:
            self._dropped(s)
        if s.replay is not None or s.no_agent:  # a branch; an episode no agent took (remote.py)
            return None
        if s.failure is None:
            self.in_row = 0
            return None
        self.in_row += 1
        if self.in_row < self.max_failures:
            return None
        why = (
            f"env.harness = {self.name}: {self.in_row} episodes in a row failed, the last ({s.key}): "
            f"{brief(s.failure)}; fix the harness (or raise env.harness_max_failures)"
        )
        return SamplerConfigFailure(why, "env.harness")

    def _dropped(self, s: Session) -> None:
        assert s.failure is not None
        log.debug("external episode %s dropped: %s", s.key, s.failure)
        self.unreported += 1
        now = time.monotonic()
        if now - self.reported_at < self.report_every_s:
            return
        if self.reported_at == -float("inf"):
            log.warning("external episode %s dropped: %s", s.key, brief(s.failure))
        else:
            log.warning(
                "external: %d episodes dropped in the last %.0f s, the last (%s): %s (counts: external/*)",
                self.unreported,
                now - self.reported_at,
                s.key,
                brief(s.failure),
            )
        self.unreported, self.reported_at = 0, now


_FIELD = re.compile(r"[\[.]")  # where a parameter's path goes below its field: messages[3].content


def refusal_reason(status: int, payload: dict[str, Any]) -> str:
    """`<status>_<reason>`: the error's type, or for a bad field `bad_<field>` (`400_bad_temperature`)."""
    err: dict[str, Any] = payload["error"] if isinstance(payload.get("error"), dict) else {}
    kind, param = str(err.get("type") or "error"), err.get("param")
    if kind == "invalid_request_error":
        kind = f"bad_{_FIELD.split(param)[0]}" if isinstance(param, str) and param else "invalid_request"
    return f"{status}_{kind}"


class Refusals:
    """Every 4xx the endpoint answers, counted by reason (`external/errors/<status>_<reason>`): the first of a
    reason is logged at WARNING with its message, then at most one line a minute per reason with how many
    since; each one at DEBUG. Thread-safe (the endpoint's thread and the sampling loop both refuse)."""

    def __init__(self, report_every_s: float = 60.0) -> None:
        self.report_every_s = report_every_s
        self._mu = threading.Lock()
        self.counts: dict[str, int] = {}
        self._since: dict[str, tuple[float, int]] = {}  # reason -> (last warning, refusals since)

    def record(self, status: int, payload: dict[str, Any], session: str | None = None) -> None:
        reason = refusal_reason(status, payload)
        message = str((payload.get("error") or {}).get("message", ""))
        where = f" (session {session})" if session else ""
        now = time.monotonic()
        with self._mu:
            self.counts[reason] = self.counts.get(reason, 0) + 1
            last, since = self._since.get(reason, (-float("inf"), 0))
            due = now - last >= self.report_every_s
            self._since[reason] = (now, 0) if due else (last, since + 1)
        log.debug("agent endpoint: %s%s: %s", reason, where, message)
        if due and last == -float("inf"):
            log.warning(
                "agent endpoint: %s%s: %s (counted: external/errors/%s)",
                reason,
                where,
                brief(message),
                reason,
            )
        elif due:
            log.warning(
                "agent endpoint: %d more %s in the last %.0f s, the last%s: %s",
                since + 1,
                reason,
                now - last,
                where,
                brief(message),
            )

    def metrics(self) -> dict[str, float]:
        with self._mu:
            return {f"external/errors/{k}": float(v) for k, v in self.counts.items()}
