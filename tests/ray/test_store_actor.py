"""The replay-store Ray shell: trees travel as Arrow IPC bytes through the object store."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from runtime.roles import start_store_actor  # noqa: E402
from storage.tree_codec import decode_ipc, decode_trees, encode_ipc, flat_batches, ipc_to_table  # noqa: E402
from system.roles import StoreRole  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from store_writer import credited, make_tree  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    if started:
        ray.shutdown()


def test_sampler_backup_learner_round_trip_through_the_actor(ray_local, tmp_path):
    store = start_store_actor(str(tmp_path / "s"), eta=1, batch_size=2)
    trees = [make_tree(i) for i in range(4)]
    assert ray.get(store.call(StoreRole.admit, 10)) == 4  # (1 + 0 + 1) * 2 - 0
    ray.get(store.call(StoreRole.put_raw, encode_ipc(trees)))
    raw = decode_ipc(ray.get(store.call(StoreRole.lease_raw_ipc, 3)))
    assert [t.tree_id for t in raw] == ["t0", "t1", "t2"] and raw[0].equals(trees[0])
    ray.get(store.call(StoreRole.put_credited, encode_ipc([credited(t) for t in raw])))
    buf = ray.get(store.call(StoreRole.take_batch_ipc, 2))
    table = ipc_to_table(buf)
    assert [f.tree_ids for f in flat_batches(table)] == [["t0", "t1"]]
    assert decode_trees(table)[1].equals(credited(trees[1]))
    assert ray.get(store.call(StoreRole.take_batch_ipc, 2)) is None  # t2 alone: no partial batch
    assert ray.get(store.call(StoreRole.watermark)) == 1
    stats = ray.get(store.call(StoreRole.stats))
    assert stats["trees"]["consumed"] == 2 and stats["trees"]["raw"] == 1
    ray.get(store.call(StoreRole.close))  # the actor ends with the session's Ray instance
