"""Agents with long contexts (issue 57): a harness that hands a sub-agent's reply to its main conversation,
summarises, compacts its history and goes on grows (4, 2) trees on a tiny model whose turns end: every
branch accepted (the sub-agent and the summary before an anchor are replayed from the trunk's record, not
sampled again), anchors after the compaction, each turn stored with the ids it was sampled after (restarts:
the learner re-scores every stored log-prob within 1e-5), and only the side trees that carry signal."""

import json

import numpy as np
import pytest

from actors.policy.hf_backend import HFBackend
from actors.policy.tiny_model import build_tiny_model
from storage.replay_store import ReplayStore
from storage.store_verify import verify_store
from system.policy import SamplingConfig
from tests.external_fixtures import (
    ending_turns,
    external_sampler,
    kb_setup,
    long_context_harness,
    worst_rescore_gap,
)


@pytest.fixture(scope="module")
def kb():
    return kb_setup()


class Counted(HFBackend):
    def sample(self, requests):
        self.sampled = getattr(self, "sampled", 0) + len(requests)
        return super().sample(requests)


def test_compaction_and_a_feeding_sub_agent_branch_without_refusals(kb, tmp_path):
    env, protocol, tok = kb
    model = ending_turns(build_tiny_model(tok, seed=0), tok.convert_tokens_to_ids(tok.eos_token))
    backend = Counted(model, tok, sampling=SamplingConfig(seed=0))
    tasks = env.tasks("train", n=1)
    sampler = external_sampler(backend, env, protocol, long_context_harness, shape=(4, 2), max_turn_tokens=16)
    try:
        trees = sampler.sample_trees(tasks, np.random.default_rng(3), ["c0"])
    finally:
        sampler.close()
    stats = sampler.external.stats
    [main, *sides] = trees
    # 4 trunks, 2 branches each: all accepted (none refused), every episode stored: K = 4·(1 + 2) = 12
    assert stats["external/branches"] == 8 and "external/branches_refused" not in stats
    assert main.num_leaves == 12 and stats["external/episodes_stored"] == 12
    calls = json.loads(main.meta["calls"])  # per trunk: main, sub-agent (conversation 1), main, summary, ...
    trunk = calls["c0/m0"]
    assert trunk[:4] == [[0, None], [1, None], [0, 0], [2, None]] and [3, None] in trunk
    # the compaction (conversation 3) continues the episode: anchors on its turns are branched
    anchors = json.loads(main.meta["anchors"])  # context 1: the conversation after the first compaction
    after = sum(a["context"] == 1 for a in anchors.values())
    assert len(anchors) == 8 and after >= 2, anchors
    # the calls a branch made before its anchor were answered from the record: only the rest was sampled
    replayed = sum(a["call"] for a in anchors.values())
    assert backend.sampled == sum(len(c) for c in calls.values()) - replayed
    # every stored turn re-scores to its stored log-probs after the ids it was sampled after
    assert main.restarts and worst_rescore_gap(trees, backend.score) <= 1e-5
    # side trees: only those whose leaves' rewards differ (the judges); the titles (one leaf each) are not
    assert all(t.meta["source"] == "external-side" and len(set(t.leaf_rewards())) > 1 for t in sides)
    assert stats["external/side_trees"] == len(sides) and stats["external/side_trees_skipped"] >= 1
    assert stats["external/compactions"] >= 4  # each trunk's, and those of the branches before it
    with ReplayStore(tmp_path / "store") as store:
        store.put_raw(trees)
    assert verify_store(tmp_path / "store").ok
