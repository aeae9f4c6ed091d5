"""Ray shell around ReplayStore: serves one store directory to samplers, backup and learner on any node.

Trees cross the object store as Arrow IPC stream bytes (`tree_codec.encode_ipc` / `decode_ipc` on the
client side), never as pickled Python node lists; the learner can also take a batch as IPC bytes of the
columns (`take_batch_ipc`) and read them with `tree_codec.ipc_to_table` + `flat_batches`, without copies.

    handle = start_store_actor("/runs/x/store", eta=2, batch_size=64)
    ray.get(handle.put_raw.remote(encode_ipc(trees)))
    trees = decode_ipc(ray.get(handle.take_raw.remote(16)))
    buf = ray.get(handle.take_batch_ipc.remote(64))      # None until 64 credited trees wait

Ray runs one call at a time on an actor (max_concurrency=1), so the store sees no concurrent calls.
"""

from __future__ import annotations

from typing import Any

import ray

from storage.replay_store import ReplayStore
from storage.tree_codec import decode_ipc, encode_ipc, table_to_ipc


class ReplayStoreShell:
    """Plain class; `ray.remote` is applied at the call site (start_store_actor)."""

    def __init__(self, directory: str, **options: Any):
        self.store = ReplayStore(directory, **options)

    def put_raw(self, buf: bytes) -> int:
        return self.store.put_raw(decode_ipc(buf))

    def put_credited(self, buf: bytes) -> int:
        return self.store.put_credited(decode_ipc(buf))

    def take_raw(self, max_trees: int) -> bytes:
        return encode_ipc(self.store.take_raw(max_trees))

    def release_raw(self, tree_ids: list[str]) -> None:
        self.store.release_raw(tree_ids)

    def take_batch_ipc(self, n: int) -> bytes | None:
        """Batch k = consumed_watermark() before the call, as IPC bytes of its rows; None if not ready."""
        table = self.store.take_batch_table(n)
        return None if table is None else table_to_ipc(table)

    def consumed_watermark(self) -> int:
        return self.store.consumed_watermark()

    def rewind_to(self, watermark: int) -> int:
        return self.store.rewind_to(watermark)

    def set_learner_version(self, version: int) -> None:
        self.store.set_learner_version(version)

    def admission_capacity(self) -> int:
        return self.store.admission_capacity()

    def admit(self, n: int) -> int:
        return self.store.admit(n)

    def release(self, n: int) -> None:
        self.store.release(n)

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def recovery_report(self) -> list[dict[str, Any]]:
        return list(self.store.recovery_report)

    def close(self) -> None:
        self.store.close()


def start_store_actor(directory: str, name: str | None = None, **options: Any) -> Any:
    """Starts the shell as a Ray actor (0 CPUs: it mostly waits on disk); returns the handle."""
    actor = ray.remote(num_cpus=0, max_concurrency=1)(ReplayStoreShell)
    if name is not None:
        actor = actor.options(name=name)
    return actor.remote(directory, **options)


class RemoteStore:
    """Client for a store actor with the local ReplayStore's tree-level methods (IPC bytes on the wire)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def put_raw(self, trees: list) -> int:
        return ray.get(self.handle.put_raw.remote(encode_ipc(trees)))

    def put_credited(self, trees: list) -> int:
        return ray.get(self.handle.put_credited.remote(encode_ipc(trees)))

    def take_raw(self, max_trees: int) -> list:
        return decode_ipc(ray.get(self.handle.take_raw.remote(max_trees)))

    def release_raw(self, tree_ids: list[str]) -> None:
        ray.get(self.handle.release_raw.remote(list(tree_ids)))

    def stats(self) -> dict[str, Any]:
        return ray.get(self.handle.stats.remote())
