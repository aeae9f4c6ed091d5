"""The replay store's Ray client: `RemoteStore`, the `StoreClient` (system/interfaces.py) the samplers, the
backup and the learner call on the store actor (a `ReplayStore` held by runtime/builder.py:StoreActor).

Trees cross the object store as Arrow IPC file bytes — the bytes a segment holds — never as pickled Python
objects: `RemoteStore` encodes trees once on the caller's side (`tree_codec.encode_ipc`), the store checks the
bytes once and commits them as they are, and it answers leases and batches with the IPC bytes of the stored
rows, which `RemoteStore` decodes (zero-copy views of the received buffer).

    handle = start_store_actor("/runs/x/store", eta=2, batch_size=64)    # runtime/roles.py: a Handle
    store = RemoteStore(handle)          # the same methods as an in-process ReplayStore
    store.put_raw(trees); store.lease_raw(16); store.take_batch(64)

Ray runs one call at a time on the actor (max_concurrency=1), so the store sees no concurrent calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from storage.tree_codec import decode_ipc, encode_ipc
from system.roles import StoreRole
from system.tree import RolloutTree


class RemoteStore:
    """`StoreClient` over a store actor: tree-level calls, Arrow IPC bytes on the wire. Picklable (it holds
    only the actor's handle, a runtime/remote.py `Handle[StoreRole]`), so it can be handed to other actors at
    construction."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def _call(self, method: Any, *args: Any) -> Any:
        """`method`: a `StoreRole` method (the handle calls only those)."""
        return ray.get(self.handle.call(method, *args))

    def put_raw(self, trees: Sequence[RolloutTree]) -> int:
        return int(self._call(StoreRole.put_raw, encode_ipc(trees)))

    def lease_raw(self, max_trees: int) -> list[RolloutTree]:
        return decode_ipc(self._call(StoreRole.lease_raw_ipc, max_trees), "store lease")

    def put_credited(self, trees: Sequence[RolloutTree]) -> int:
        return int(self._call(StoreRole.put_credited, encode_ipc(trees)))

    def take_batch(self, n: int) -> list[RolloutTree] | None:
        buf = self.take_batch_ipc(n)
        return None if buf is None else decode_ipc(buf, "store batch")

    def take_batch_ipc(self, n: int) -> bytes | None:
        """The batch as the store's IPC bytes, undecoded (the sharded learner forwards them to its ranks)."""
        return self._call(StoreRole.take_batch_ipc, n)

    def admit(self, n: int) -> int:
        return int(self._call(StoreRole.admit, n))

    def release(self, n: int) -> None:
        self._call(StoreRole.release, n)

    def watermark(self) -> int:
        return int(self._call(StoreRole.watermark))

    def rewind_to(self, watermark: int) -> int:
        return int(self._call(StoreRole.rewind_to, watermark))

    def set_learner_version(self, version: int) -> None:
        self._call(StoreRole.set_learner_version, version)

    def limit_lag(self, lag: int | None) -> None:
        self._call(StoreRole.limit_lag, lag)

    def stats(self) -> dict[str, Any]:
        return dict(self._call(StoreRole.stats))
