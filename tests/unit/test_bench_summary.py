"""`make bench`'s markdown summary: each figure beside its goal and its same-run baseline."""

from __future__ import annotations

from benchmarks.summary import GOALS, render, verdicts


def test_verdicts_compare_each_figure_with_its_goal():
    results = {
        "store": {"zero_copy_over_pickle": 43.2, "read_zero_copy_mb_s": 650.0, "pickle_read_mb_s": 15.0},
        "weights": {"broadcast_over_raw_zmq": 0.7, "fanout4_over_fanout1": 1.2, "broadcast_s_1": 0.1},
        "pipeline": {"error": "not implemented yet"},
    }
    by = {(v["bench"], v["figure"]): v for v in verdicts(results)}
    assert len(by) == len(GOALS)
    assert by[("store", "zero_copy_over_pickle")]["ok"] is True  # 43.2 >= 10
    assert by[("weights", "broadcast_over_raw_zmq")]["ok"] is False  # 0.7 < 0.8
    assert by[("weights", "fanout4_over_fanout1")]["ok"] is True  # 1.2 <= 1.5
    assert by[("learner", "packed_speedup")]["ok"] is None  # not measured: no verdict
    assert by[("store", "zero_copy_over_pickle")]["baselines"] == {
        "read_zero_copy_mb_s": 650.0,
        "pickle_read_mb_s": 15.0,
    }
    md = render(results, "Commit abc.")
    assert (
        "| store | `zero_copy_over_pickle`: zero-copy Arrow reads over pickle, same nodes | 43.2 | >= 10 "
        in md
    )
    assert "| 0.7 | >= 0.8 | broadcast_s_1 0.1 | **no** |" in md
    assert "error: not implemented yet" in md and "Commit abc." in md
