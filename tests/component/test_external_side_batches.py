"""Side trees take no learner batch slot (issue 47): a rollout batch of B trees is B main trees, each with its
side trees in the same batch (storage/linked.py); admission counts main trees only; a side tree is never
handed out without its episode tree, nor lost on a rewind or a reopen. Before this, `take_batch(2)` gave
[t0, t0/side0]: one episode tree crowded out by its own side tree."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest

from storage.replay_store import ReplayStore
from system.tree import RolloutTree
from tests.external_fixtures import ToolScript, external_sampler, kb_setup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from store_writer import credited, make_tree


def side(episode: RolloutTree, j: int) -> RolloutTree:
    """A side tree of `episode`, as actors/external/side.py makes one: id `<tree>/side<j>`, episode_tree."""
    meta = {"source": "external-side", "episode_tree": episode.tree_id}
    return RolloutTree.build(f"{episode.tree_id}/side{j}", episode.nodes, episode.prompt_id, meta)


def test_a_batch_counts_main_trees_and_takes_their_side_trees_along(tmp_path):
    t0, t1, t2, t3 = (make_tree(i) for i in range(4))
    first = [t0, side(t0, 0), side(t0, 1), t1, t2, side(t2, 0)]  # one sampler's commit: 3 episodes, 3 sides
    with ReplayStore(tmp_path, eta=1, batch_size=2) as store:
        assert (store.admit(3), store.admit(1)) == (3, 1)  # capacity (η + v + 1)·B = (1 + 0 + 1)·2 = 4
        store.put_raw(first)
        # the commit used up its 3 main trees' reservations, not 6: the other sampler's 1 is still held;
        # produced = 3 main trees + 1 reserved = 4 -> capacity 0 (before: 6 trees + 0 reserved -> -2)
        assert store.stats()["admission"]["reserved"] == 1 and store.admission_capacity() == 0
        store.put_credited([credited(t) for t in first[:2] + first[3:4]])  # t0, t0/side0, t1
        assert store.take_batch_ids(2) is None  # t0's side1 is not credited yet: the batch waits for it
        store.put_credited([credited(t) for t in first[2:3] + first[4:]])
        b0 = ["t0", "t0/side0", "t0/side1", "t1"]  # B = 2 main trees; t0's 2 side trees ride along
        assert store.take_batch_ids(2) == b0
        assert store.take_batch_ids(2) is None  # 1 main tree left (t2, with its side): not a batch
        store.put_raw([t3, side(make_tree(9), 0)])  # t3, and an orphan: a side tree of a tree never stored
        store.put_credited([credited(t3), credited(side(make_tree(9), 0))])
        b1 = ["t2", "t2/side0", "t3"]
        assert store.take_batch_ids(2) == b1
        assert store.stats()["side_trees"] == {"total": 4, "orphans": 1}
        assert store.rewind_to(0) == 4 + 3  # both batches come back, side trees included
        assert [store.take_batch_ids(2), store.take_batch_ids(2)] == [b0, b1]  # the same batches again
    with ReplayStore(tmp_path) as store:  # reopened: the links come from the stored meta
        assert store.stats()["side_trees"] == {"total": 4, "orphans": 1}
        assert store.tree_ids("credited") == ["t9/side0"]  # the orphan: never handed out, still stored
        assert [store.batch_tree_ids(k) for k in (0, 1)] == [b0, b1]


def judged(task, base_url, session):
    """One main turn, then a judge (a side call: one side tree per episode tree), reward 1."""
    c = openai.OpenAI(base_url=base_url, api_key=task["api_key"])
    msgs = [
        {"role": "system", "content": task["system_prompt"]},
        {"role": "user", "content": task["question"]},
    ]
    c.chat.completions.create(model="m", messages=msgs, tools=task["tools"])
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Judge: " + task["question"]}])
    return 1.0


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


def test_a_sampler_commits_side_trees_beyond_its_reservation_and_they_train_with_their_episode(kb, tmp_path):
    env, protocol, tok = kb
    tasks = env.tasks("train", n=4)
    with ReplayStore(tmp_path, eta=0, batch_size=2) as store:
        backend = ToolScript(tok, tasks)
        sampler = external_sampler(
            backend, env, protocol, judged, shape=(2, 0), store=store, tasks=tasks, side_calls="all"
        )
        try:
            out = sampler.sample_and_commit(2)
        finally:
            sampler.close()
        # 2 episode trees (M = 2 trunks each) + 1 side tree each (both judges share a prompt; stored though
        # their rewards are equal: env.side_calls=all): 4 trees
        assert (out["admitted"], out["trees"]) == (2.0, 4.0)
        # the reservation of 2 was used by the 2 main trees, none left, none given back twice; capacity
        # (0 + 0 + 1)·2 − 2 main trees = 0 (before: 2 − 4 trees = −2, the side trees taking slots)
        assert store.stats()["admission"]["reserved"] == 0 and store.admission_capacity() == 0
        trees = store.get_trees(store.tree_ids("raw"))
        store.put_credited([credited(t) for t in trees])
        batch = store.take_batch(2)
    assert batch is not None
    mains = [t for t in batch if "episode_tree" not in t.meta]
    sides = [t for t in batch if "episode_tree" in t.meta]
    assert len(mains) == 2 and len(sides) == 2  # B = 2 main trees, still, and both side trees with them
    assert sorted(t.meta["episode_tree"] for t in sides) == sorted(t.tree_id for t in mains)
    assert all(t.num_leaves == 2 for t in batch)  # 2 episodes per tree, 1 judge leaf per episode
    assert [t.meta["source"] for t in sides] == ["external-side"] * 2
