"""In-process twin of the weight broadcast: `WeightSource` and `WeightSink` in one, no sockets or files.

It goes through the same codec and checks as WeightPublisher + WeightSubscriber (system/weight_codec.py):
`publish` snapshots the tensors into one payload with its chunk checksums; each reader verifies a private
copy of it before it returns it. `sink()` gives another independent reader of the same channel.

Usage::

    ch = InMemoryWeightChannel()
    ch.publish(model.state_dict(), version=1)
    version, tensors = ch.poll()        # None when nothing newer than the last poll
    late = ch.sink(lag=2)               # a reader held 2 versions behind (the staleness table's samplers)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from system.weight_codec import WeightAssembler, encode_weights


class _Latest:
    """The newest messages of a channel, shared by its readers: the last `keep` versions (a lagged reader
    reads an older one)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = -1
        self.keep = 1
        self.messages: OrderedDict[int, tuple[bytes, bytes]] = OrderedDict()

    def newest_at_most(self, version: int) -> int | None:
        """The newest kept version ≤ `version` (None: none kept)."""
        return max((v for v in self.messages if v <= version), default=None)


class InMemoryWeightChannel:
    """See the module docstring. `bfloat16`: "torch" (torch.bfloat16 tensors) or "uint16" (raw bits)."""

    def __init__(
        self, chunk_mb: float = 4, bfloat16: str = "torch", _shared: _Latest | None = None, lag: int = 0
    ) -> None:
        self.chunk_bytes = max(1, int(chunk_mb * 2**20))
        self.bfloat16 = bfloat16
        self._shared = _shared or _Latest()
        self.lag = lag  # this reader gets the newest version ≤ (latest published − lag)
        self.version = -1  # last version returned by poll
        with self._shared.cond:
            self._shared.keep = max(self._shared.keep, lag + 1)

    def sink(self, lag: int = 0) -> InMemoryWeightChannel:
        return InMemoryWeightChannel(self.chunk_bytes / 2**20, self.bfloat16, self._shared, lag)

    def publish(self, named_tensors: Mapping[str, Any], version: int) -> None:
        box = self._shared
        if version <= box.version:
            raise ValueError(f"version {version} is not newer than the last published {box.version}")
        payload: list[bytearray] = []

        def sink(total: int) -> bytearray:  # the copy into it is the snapshot
            payload.append(bytearray(total))
            return payload[0]

        header, _ = encode_weights(named_tensors, version, self.chunk_bytes, sink=sink)
        with box.cond:
            box.version = version
            box.messages[version] = (header, bytes(payload[0]))
            while len(box.messages) > box.keep:
                box.messages.popitem(last=False)
            box.cond.notify_all()

    def poll(self, timeout_ms: int = 0) -> tuple[int, dict[str, Any]] | None:
        box = self._shared

        def target() -> int | None:
            v = box.newest_at_most(box.version - self.lag)
            return v if v is not None and v > self.version else None

        with box.cond:
            if not box.cond.wait_for(lambda: target() is not None, timeout_ms / 1000):
                return None
            header, payload = box.messages[target()]  # type: ignore[index]
        asm = WeightAssembler(header, bytearray(payload))  # a private copy per reader
        asm.verify_buffer()
        self.version = asm.header.version
        return self.version, asm.finish(self.bfloat16)
