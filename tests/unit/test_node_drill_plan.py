"""The node drill's plan and verdict (faults/node_plan.py): the --kill-node spec, the fake cluster's nodes
and pools, the trees committed before a kill that the store no longer holds, a one-line stop."""

from __future__ import annotations

import pytest

from faults.node_plan import (
    node_layout,
    node_verdict,
    parse_kill_nodes,
    pool_overrides,
    stopped_with_one_line,
    trees_lost,
)


def test_kill_node_spec_parses_roles_and_steps():
    assert parse_kill_nodes("learner@4,store@9", 16) == [(4, "learner"), (9, "store")]
    assert parse_kill_nodes(" sampler-node@3 , learner@8", 10) == [(3, "sampler"), (8, "learner")]
    assert parse_kill_nodes("learner@2,learner@5", 6) == [(2, "learner"), (5, "learner")]


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("backup@3", "ROLE one of sampler, learner, store"),
        ("learner", "expected ROLE@STEP"),
        ("learner@x", "'x' is not an integer"),
        ("learner@0", r"in 1\.\.15"),
        ("learner@16", r"in 1\.\.15"),
        ("store@5,learner@5", "strictly increase"),
        ("store@6,learner@5", "strictly increase"),
    ],
)
def test_a_bad_kill_node_spec_names_its_part(spec, why):
    with pytest.raises(ValueError, match=why):
        parse_kill_nodes(spec, 16)


def test_layout_and_overrides_keep_learner_store_and_samplers_apart():
    assert [n.pool for n in node_layout(3)] == ["train", "store", "sample"]
    assert [n.pool for n in node_layout(5)] == ["train", "store", "sample", "sample", "sample"]
    with pytest.raises(ValueError, match="at least 3 nodes"):
        node_layout(2)
    assert pool_overrides() == [
        "resources.sampler.pool=sample",
        "resources.learner.pool=train",
        "resources.store.pool=store",
        "resources.backup.pool=train",
    ]


def test_trees_lost_are_those_committed_before_a_kill_and_gone_at_the_end():
    assert trees_lost([{"a", "b"}, {"a", "b", "c"}], {"a", "b", "c", "d"}) == []
    assert trees_lost([{"a", "b"}, {"c"}], {"a"}) == ["b", "c"]
    assert trees_lost([], set()) == []


def test_one_line_stop_needs_the_reason_and_no_traceback():
    reason = ["treeopsd train: learner died 4 times", "continue from the last checkpoint with: ..."]
    assert stopped_with_one_line(1, reason)
    assert not stopped_with_one_line(0, reason)  # exit 0 is no stop
    assert not stopped_with_one_line(1, ["Traceback (most recent call last):", *reason])
    assert not stopped_with_one_line(1, ["Killed"])


def audit(**checks_changed):
    checks = {
        "exit_0": True,
        "reached_all_steps": True,
        "no_tree_in_two_batches": True,
        "store_verify_clean": True,
        "no_tree_lost_duplicated_or_half_visible": True,
    }
    return {"checks": checks | checks_changed, "returncode": 0, "batches_trained_twice": []}


PLAN = [(3, "learner"), (6, "store")]
KILLS = [
    {"at": 3, "role": "learner", "survivors": [], "handed_out": 3},
    {"at": 6, "role": "store", "survivors": [], "handed_out": 7},
]


def test_node_verdict_healed_stopped_and_failed():
    healed = node_verdict(audit(), PLAN, KILLS, [], [], 10)
    assert healed["ok"] and healed["outcome"] == "healed"
    stop = {**audit(exit_0=False, reached_all_steps=False), "returncode": 1}
    stopped = node_verdict(stop, PLAN, KILLS, [], ["treeopsd train: the store died 4 times"], 10)
    assert stopped["ok"] and stopped["outcome"] == "stopped"
    crashed = node_verdict(stop, PLAN, KILLS, [], ["Traceback (most recent call last):"], 10)
    assert not crashed["ok"] and crashed["outcome"] == "failed"
    lost = node_verdict(audit(), PLAN, KILLS, ["t1"], [], 10)
    assert not lost["ok"] and not lost["node_checks"]["no_committed_tree_lost"]
    twice = node_verdict({**audit(), "batches_trained_twice": [2]}, PLAN, KILLS, [], [], 10)
    assert not twice["ok"] and not twice["node_checks"]["no_batch_trained_twice"]
    survivor = [KILLS[0], {**KILLS[1], "survivors": [123]}]
    left = node_verdict(audit(), PLAN, survivor, [], [], 10)
    assert not left["node_checks"]["no_process_of_a_killed_node_survives"]
    assert not node_verdict(audit(), PLAN, KILLS[:1], [], [], 10)["node_checks"]["planned_nodes_killed"]
    late = [KILLS[0], {**KILLS[1], "handed_out": 10}]  # the run had handed out its last batch
    assert not node_verdict(audit(), PLAN, late, [], [], 10)["node_checks"][
        "every_kill_before_the_last_batch"
    ]
