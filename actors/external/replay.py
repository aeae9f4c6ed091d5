"""Prefix forcing: a branch's model calls before its anchor answered from the record of the episode it
branches from, token for token; from the anchor on, sampled.

    record = [RecordedCall(context_ids, turn), ...]     # every model call of the trunk, in call order
    replay = PrefixReplay(record, upto=5)               # a branch whose anchor is the trunk's call 5
    for each model call of the branch, with the ids it would be sampled after:
        rec = replay.answer(context_ids)                # calls 0..4: the recorded call (its turn, as sent)
        if rec is None: sample                          # call 5 on: None (call 5's context is checked first)

The contract is the harness's determinism, checked per call: the branch's call i must be sampled after
exactly the ids the trunk's call i was (prompt, sampled turns, observations, in whatever conversation the
call belongs to: a summary, a sub-agent, a compaction's new context), else `ReplayMismatch` names the call
and the first differing position. Calls are matched by their order alone, so a call that is no extension of
the main conversation (a sub-agent whose reply feeds it, a summariser before a compaction) is replayed like
any other: a branch never samples a call that lies before its anchor, and whatever those calls fed into
its context is the trunk's. The anchor's own call (index `upto`) is checked too and then sampled.

Nothing here knows HTTP, sessions or chat templates: the endpoint (actors/external/turns.py) computes a
call's context ids and sends back the recorded turn's message; any other driver of recorded episodes (e.g.
a harness-based environment run through this endpoint) can reuse it with its own record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class ReplayMismatch(Exception):
    """A branch's call whose context differs from the recorded one (a non-deterministic harness)."""


@dataclass(frozen=True)
class RecordedCall:
    """One model call as it was answered: the ids it was sampled after and what was sampled (any object:
    the endpoint's `Turn`, with its ids, log-probs and the message returned)."""

    context: Sequence[int]
    turn: Any


def first_difference(got: Sequence[int], want: Sequence[int]) -> str | None:
    """Where two id sequences part (None: equal), in words."""
    if len(got) == len(want) and list(got) == list(want):
        return None
    n = min(len(got), len(want))
    at = next((i for i in range(n) if got[i] != want[i]), n)
    return f"{len(got)} context ids against the record's {len(want)}, first different at position {at}"


class PrefixReplay:
    def __init__(self, record: Sequence[RecordedCall], upto: int) -> None:
        if not 0 <= upto < len(record):
            raise ValueError(f"an anchor at call {upto} of a record of {len(record)} calls")
        self.record, self.upto = list(record), upto
        self.calls = 0  # calls answered or passed so far

    @property
    def forcing(self) -> bool:
        """The next call lies before the anchor: it will be answered from the record."""
        return self.calls < self.upto

    def answer(self, context: Sequence[int]) -> RecordedCall | None:
        """The next call's recorded answer while it lies before the anchor, else None (sample it). Its
        context must be the recorded call's, for the anchor's call too: else ReplayMismatch."""
        i = self.calls
        if i <= self.upto:
            why = first_difference(context, self.record[i].context)
            if why is not None:
                where = "the anchor's call" if i == self.upto else f"call {i}"
                raise ReplayMismatch(f"{where} differs from the record ({why}): a non-deterministic harness?")
        self.calls += 1
        return self.record[i] if i < self.upto else None
