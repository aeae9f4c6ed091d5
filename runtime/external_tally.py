"""The run's `external/*` counters (an agent through the endpoint, `env.harness`): summed over the samplers,
cumulative over the run, for the console step line and summary.json (docs/external-agents.md, "Metrics").

    tally = ExternalTally()
    tally.update(actor_id, incarnation, snapshot)   # each sampler call's metrics snapshot (runtime/driver.py)
    tally.retire(actor_id)                          # a sampler removed: its counts stay in the run's totals
    tally.totals()      # {"episodes": 12.0, "side_calls": 3.0, ...}: over every sampler and incarnation
    tally.short()       # "ext 12ep 3side 0drop": the step line's part (", no agent: sampler 1 (4 drop)")
    tally.unserved()    # {1: 4}: the samplers no agent served, and the episodes that cost them

A sampler's counters count from its start: a restarted sampler (another incarnation, `TreeSampler.prefix`)
starts from 0 again, so the last snapshot of each incarnation is banked before the next one's is taken.
Gauges (`external/failures_in_row`: trunks dropped in a row now; `external/sampler_index`) are no run
totals and are left out. A sampler whose episodes no agent took (`external/no_agent`: remote.py's
`NoAgent`) is named by its index on the step line and in summary.json (`no_agent_samplers`: {index: drops}).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PREFIX = "external/"
GAUGES = frozenset({"external/failures_in_row", "external/sampler_index"})
NO_AGENT = "external/no_agent"
# always in summary.json's `external` (0 when nothing happened), whatever else was counted
SHOWN = (
    "episodes",
    "episodes_stored",
    "episodes_dropped",
    "side_calls",
    "side_trees",
    "requests",
    "rejected_requests",
    "double_rewards",
    "no_reward",
    "limit_ended",
)


class ExternalTally:
    def __init__(self) -> None:
        self.banked: dict[str, float] = {}  # finished incarnations and removed samplers
        self.latest: dict[int, tuple[str | None, dict[str, float]]] = {}  # per sampler: (incarnation, counts)
        self.index: dict[int, int] = {}  # per sampler: its index (logs/sampler-<i>.log)
        self.no_agent: dict[int, float] = {}  # per sampler index: banked episodes no agent took

    def update(self, actor_id: int, incarnation: str | None, snapshot: Mapping[str, float]) -> None:
        counts = {k: float(v) for k, v in snapshot.items() if k.startswith(PREFIX) and k not in GAUGES}
        old = self.latest.get(actor_id)
        if old is not None and old[0] != incarnation:  # restarted: the old incarnation's counts are final
            self._bank(old[1], actor_id)
        self.latest[actor_id] = (incarnation, counts)
        self.index[actor_id] = int(snapshot.get("external/sampler_index", self.index.get(actor_id, actor_id)))

    def retire(self, actor_id: int) -> None:
        old = self.latest.pop(actor_id, None)
        if old is not None:
            self._bank(old[1], actor_id)

    def _bank(self, counts: dict[str, float], actor_id: int) -> None:
        for k, v in counts.items():
            self.banked[k] = self.banked.get(k, 0.0) + v
        i = self.index.get(actor_id, actor_id)
        self.no_agent[i] = self.no_agent.get(i, 0.0) + counts.get(NO_AGENT, 0.0)

    def unserved(self) -> dict[int, int]:
        """{sampler index: episodes dropped because no agent took them}, for the samplers that had any."""
        out = dict(self.no_agent)
        for actor_id, (_, counts) in self.latest.items():
            i = self.index.get(actor_id, actor_id)
            out[i] = out.get(i, 0.0) + counts.get(NO_AGENT, 0.0)
        return {i: int(n) for i, n in sorted(out.items()) if n > 0}

    def totals(self) -> dict[str, float]:
        """Every counter without its prefix, summed over samplers and incarnations; the SHOWN ones always."""
        out = dict.fromkeys(SHOWN, 0.0)
        for counts in (self.banked, *(c for _, c in self.latest.values())):
            for k, v in counts.items():
                name = k.removeprefix(PREFIX)
                out[name] = out.get(name, 0.0) + v
        return out

    def summary(self) -> dict[str, Any]:
        """summary.json's `external`: the totals, counts as integers; `no_agent` by sampler, if any."""
        out: dict[str, Any] = {
            k: int(v) if float(v).is_integer() else v for k, v in sorted(self.totals().items())
        }
        unserved = self.unserved()
        if unserved:
            out["no_agent_samplers"] = {str(i): n for i, n in unserved.items()}
        return out

    def short(self) -> str:
        """`ext 12ep 3side 0drop`: episodes run, side calls, episodes dropped (summed, since the start)."""
        t = self.totals()
        line = f"ext {t['episodes']:.0f}ep {t['side_calls']:.0f}side {t['episodes_dropped']:.0f}drop"
        unserved = ", ".join(f"sampler {i} ({n} drop)" for i, n in self.unserved().items())
        return f"{line}, no agent: {unserved}" if unserved else line
