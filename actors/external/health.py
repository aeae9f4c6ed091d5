"""A harness's record across sampling rounds: failed episodes in a row (a bound stops the run) and the
drop warnings, rate-limited.

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
import time

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
        if s.replay:  # a branch
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
