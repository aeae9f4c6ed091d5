"""In-process twin of the weight broadcast: `WeightSource` and `WeightSink` in one, no sockets or files.

It goes through the same codec and checks as WeightPublisher + WeightSubscriber (system/weight_codec.py):
`publish` snapshots the tensors into one payload with its chunk checksums; each reader verifies a private
copy of it before it returns it. `sink()` gives another independent reader of the same channel.

Usage::

    ch = InMemoryWeightChannel()
    ch.publish(model.state_dict(), version=1)
    version, tensors = ch.poll()        # None when nothing newer than the last poll
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from system.weight_codec import WeightAssembler, encode_weights


class _Latest:
    """The newest message of a channel, shared by its readers."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = -1
        self.message: tuple[bytes, bytes] = (b"", b"")


class InMemoryWeightChannel:
    """See the module docstring. `bfloat16`: "torch" (torch.bfloat16 tensors) or "uint16" (raw bits)."""

    def __init__(self, chunk_mb: float = 4, bfloat16: str = "torch", _shared: _Latest | None = None) -> None:
        self.chunk_bytes = max(1, int(chunk_mb * 2**20))
        self.bfloat16 = bfloat16
        self._shared = _shared or _Latest()
        self.version = -1  # last version returned by poll

    def sink(self) -> InMemoryWeightChannel:
        return InMemoryWeightChannel(self.chunk_bytes / 2**20, self.bfloat16, self._shared)

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
            box.version, box.message = version, (header, bytes(payload[0]))
            box.cond.notify_all()

    def poll(self, timeout_ms: int = 0) -> tuple[int, dict[str, Any]] | None:
        box = self._shared
        with box.cond:
            if not box.cond.wait_for(lambda: box.version > self.version, timeout_ms / 1000):
                return None
            header, payload = box.message
        asm = WeightAssembler(header, bytearray(payload))  # a private copy per reader
        asm.verify_buffer()
        self.version = asm.header.version
        return self.version, asm.finish(self.bfloat16)
