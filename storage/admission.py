"""The replay store's staleness admission (AReaL's, docs/design.md §4), held by `ReplayStore` under its lock.

capacity = (η + v + 1)·B − produced, v = the learner's version, produced = main trees in the store plus
outstanding reservations (system/staleness.py `admission_capacity`). η is `store.eta`, lowered while the
learner's measured drift is high (`store.max_turn_kl`: the learner calls `limit_lag` with the lag that keeps a
turn's KL within the bound, system/staleness.py `drift_lag`).
"""

from __future__ import annotations

from dataclasses import dataclass

from system.staleness import admission_capacity


@dataclass
class Admission:
    eta: int | None = None  # None: every call names its own
    batch_size: int | None = None
    learner_version: int = 0
    reserved: int = 0  # trees admitted and not yet committed
    lag_limit: int | None = None  # None: eta alone

    def capacity(self, produced: int, eta: int | None = None, batch_size: int | None = None) -> int:
        """Trees a sampler may still start (negative when the learner fell behind)."""
        eta = self.eta if eta is None else eta
        b = self.batch_size if batch_size is None else batch_size
        if eta is None or b is None:
            raise ValueError("admission needs eta and batch_size (constructor or call)")
        if self.lag_limit is not None:
            eta = min(eta, self.lag_limit)
        return admission_capacity(eta, self.learner_version, b, produced + self.reserved)

    def limit_lag(self, lag: int | None) -> None:
        self.lag_limit = None if lag is None else max(0, int(lag))

    def stats(self) -> dict[str, int | None]:
        return {"learner_version": self.learner_version, "reserved": self.reserved, "lag": self.lag_limit}
