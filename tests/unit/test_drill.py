"""The fire drill's pure parts: the kill plan (faults/campaign.py), the learner's lineage of trained batches,
and the verdict over what the run's files say (faults/audit.py, shared with the soak)."""

import pytest

from faults.audit import lineage
from faults.audit import verdict as drill_verdict
from faults.campaign import kill_plan
from faults.processes import ROLES


def test_kill_plan_kills_each_role_once_at_distinct_steps_inside_the_run():
    plan = kill_plan(300, ROLES, seed=0)
    steps = [s for s, _ in plan]
    assert sorted(r for _, r in plan) == sorted(ROLES) and steps == sorted(steps)
    assert len(set(steps)) == 4 and all(1 <= s <= 150 for s in steps)  # the first half of 300 steps
    assert kill_plan(300, ROLES, seed=0) == plan and kill_plan(300, ROLES, seed=1) != plan  # seeded
    # the smallest run that fits: 5 steps, kills at 1, 2, 3, 4 (the only 4 distinct steps in [1, 4])
    assert [s for s, _ in kill_plan(5, ROLES, seed=3)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="a drill of 4 kills needs at least 5 steps, got 4"):
        kill_plan(4, ROLES, seed=0)


def test_lineage_undoes_steps_a_restarted_learner_logs_again():
    # steps 1-4 trained batches 0-3; the learner died and restarted from the checkpoint of step 2, so it
    # logged steps 3 and 4 again (batches 2 and 3 once more), then went on to step 5
    events = [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0), (3, 2.0), (4, 3.0), (5, 4.0)]
    assert lineage(events) == {1: 0, 2: 1, 3: 2, 4: 3, 5: 4}
    # a rewind to step 1 drops steps 2-5 even when the re-logged step carries another batch
    assert lineage([*events, (2, 7.0)]) == {1: 0, 2: 7}


def verdict(**changes):
    plan = [(1, "sampler"), (2, "backup"), (3, "store"), (4, "learner")]
    base = {
        "steps": 5,
        "returncode": 0,
        "plan": plan,
        "kills": [(s, r, 100 + s) for s, r in plan],
        "trained": {1: 0, 2: 1, 3: 2, 4: 3, 5: 4},
        "batches": [["a"], ["b"], ["c"], ["d"], ["e"]],
        "store_errors": [],
    }
    return drill_verdict(**{**base, **changes})


def test_verdict_holds_for_a_sound_run_and_names_each_broken_check():
    assert verdict()["ok"] and all(verdict()["checks"].values())
    assert verdict(returncode=1)["checks"]["exit_0"] is False
    missed = verdict(kills=[(1, "sampler", 101)])
    assert not missed["ok"] and missed["checks"]["each_role_killed_once"] is False
    twice = verdict(trained={1: 0, 2: 1, 3: 1, 4: 3, 5: 4})  # batch 1 trained at steps 2 and 3, 2 never
    assert twice["batches_trained_twice"] == [1] and twice["batches_skipped"] == [2]
    assert twice["checks"]["every_batch_trained_once"] is False and twice["checks"]["reached_all_steps"]
    short = verdict(trained={1: 0, 2: 1, 3: 2, 4: 3})
    assert short["checks"]["reached_all_steps"] is False and short["batches_skipped"] == [4]
    dup = verdict(batches=[["a"], ["b"], ["c"], ["d"], ["a"]])
    assert dup["checks"]["no_tree_in_two_batches"] is False and dup["checks"]["store_batches_match"]
    bad = verdict(store_errors=["segments/raw-1.arrow: does not decode"])
    assert bad["checks"]["store_verify_clean"] is False
    assert [k for k, v in verdict(batches=[["a"]] * 4)["checks"].items() if not v] == [
        "store_batches_match",
        "no_tree_in_two_batches",
    ]
