"""The run's `external/*` counters (issue 47): summed over samplers, cumulative over the run through a
sampler's restart (its counters start from 0 again) and its retirement; the step line's short form."""

from runtime.external_tally import ExternalTally
from runtime.progress import step_line


def test_counters_sum_over_samplers_and_survive_restarts_and_retirement():
    t = ExternalTally()
    t.update(0, "s0-a", {"external/episodes": 4.0, "external/side_calls": 2.0, "sampler/trees": 9.0})
    t.update(1, "s1-a", {"external/episodes": 6.0, "external/episodes_dropped": 1.0})
    t.update(0, "s0-a", {"external/episodes": 8.0, "external/side_calls": 3.0})  # same incarnation: latest
    t.update(0, "s0-b", {"external/episodes": 2.0, "external/failures_in_row": 5.0})  # restarted: from 0
    t.retire(1)  # removed by a scale-down: its 6 episodes stay counted
    totals = t.totals()
    # episodes: 8 (s0's first incarnation) + 2 (its second) + 6 (sampler 1, retired) = 16
    assert (totals["episodes"], totals["side_calls"], totals["episodes_dropped"]) == (16.0, 3.0, 1.0)
    assert "failures_in_row" not in totals and "sampler/trees" not in totals  # a gauge; not external/*
    assert totals["double_rewards"] == 0.0  # the shown counters are there when nothing happened
    assert t.summary()["episodes"] == 16 and isinstance(t.summary()["episodes"], int)
    assert t.short() == "ext 16ep 3side 1drop"


def test_the_step_line_carries_the_external_counters_only_when_given():
    m = {"reward/mean": 0.5, "learner/loss": 0.25, "learner/step_s": 2.0}
    base = "step 3/9: reward 0.500, loss 0.2500, learner 2.00 s/step"
    assert step_line(m, 3, 9) == base
    assert step_line(m, 3, 9, "ext 12ep 3side 0drop") == base + ", ext 12ep 3side 0drop"


def test_a_sampler_no_agent_serves_is_named_with_its_drops():
    """Sampler 1 (actor 7) gets no agent: its episodes are dropped as `external/no_agent`, 3 before its
    restart and 2 after; the step line and summary.json name it, by its index, with the 5 drops."""
    t = ExternalTally()
    t.update(3, "s0-a", {"external/episodes": 4.0, "external/sampler_index": 0.0})
    t.update(
        7,
        "s1-a",
        {
            "external/episodes": 3.0,
            "external/episodes_dropped": 3.0,
            "external/no_agent": 3.0,
            "external/sampler_index": 1.0,
        },
    )
    t.update(
        7,
        "s1-b",
        {
            "external/episodes": 2.0,
            "external/episodes_dropped": 2.0,
            "external/no_agent": 2.0,
            "external/sampler_index": 1.0,
        },
    )
    assert t.unserved() == {1: 5}
    assert t.short() == "ext 9ep 0side 5drop, no agent: sampler 1 (5 drop)"
    summary = t.summary()
    assert (summary["no_agent"], summary["no_agent_samplers"]) == (
        5,
        {"1": 5},
    ) and "sampler_index" not in summary
