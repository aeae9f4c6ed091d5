"""What `treeopsd demo` prints about learning (launch/cmd_demo.py, experiments/evaluation.py): the paired
difference of held-out success before and after training with its standard error, and the training reward
in windows of steps."""

import math

import pytest

from experiments.evaluation import paired_difference
from launch.cmd_demo import reward_windows


def test_paired_difference_by_hand():
    before = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0, "x": 1.0}
    after = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "y": 0.0}  # x, y: in one evaluation only, left out
    gain, se, n = paired_difference(before, after)
    # d = (1, 0, 1, 0): mean 0.5, sample variance (4 · 0.25) / 3 = 1/3, SE = sqrt(1/3 / 4) = 0.2887
    assert n == 4 and gain == 0.5 and se == pytest.approx(math.sqrt(1 / 12), rel=1e-12)
    assert paired_difference({"a": 1.0}, {"a": 0.0})[0] == -1.0 and math.isnan(paired_difference({}, {})[1])


def test_reward_windows_by_hand():
    points = [(s, 0.1 if s <= 20 else 0.3) for s in range(1, 51)]  # steps 1..50
    # windows 1–20: 0.1; 21–40: 0.3; 41–50 is half a window of 20: it counts
    assert reward_windows(points, 20) == [0.1, 0.3, 0.3]
    assert reward_windows(points[:45], 20) == [0.1, 0.3]  # 41–45: a quarter window, dropped
    assert reward_windows([(3, 0.5)], 20) == [0.5] and reward_windows([], 20) == []


def test_demo_markdown_reads_the_report():
    from launch.cmd_demo import render_markdown

    report = {"steps": 200, "train_s": 290.4, "wall_s": 422.0, "paired_tasks": 80, "commit": "abc1234"}
    report.update(success_before=0.325, success_after=0.5, success_gain=0.175, success_gain_paired_se=0.0527)
    report["per_hop_before"] = {"4": {"n": 40, "success": 0.65}}
    report["per_hop_after"] = {"4": {"n": 40, "success": 0.7}}
    report["train_reward_windows"] = [0.16, 0.3]
    md = render_markdown(report)
    # 0.175 / 0.0527 = 3.32 SE; 422 s = 7.0 min
    assert "0.325 before → 0.500 after, +0.175 ± 0.053 (paired standard error; 3.3 SE)" in md
    assert "200 asynchronous TreeOPSD steps in 290 s, 7.0 min from start to end, at commit abc1234." in md
    assert "* 4-hop (40 questions): 0.650 → 0.700" in md and "0.16 → 0.30" in md


def test_demo_report_pairs_sampled_success_and_shows_how_answers_ended(tmp_path):
    from launch.cmd_demo import demo_report, render_markdown

    def result(greedy, sampled, answered, malformed, f1):
        n = len(greedy)
        finish = {"answer": round(answered * n), "malformed": round(malformed * n)}
        return {
            "success": sum(greedy.values()) / n,
            "n": n,
            "f1": f1,
            "answered": answered,
            "finish": finish,
            "task_rewards": greedy,
            "samples": 4,
            "sampled_success": sum(sampled.values()) / n,
            "sampled_task_rewards": sampled,
        }

    before = result(
        {"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0}, {"a": 0.0, "b": 0.25, "c": 0.5, "d": 0.0}, 0.5, 0.25, 0.1
    )
    after = result(
        {"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.0}, {"a": 0.5, "b": 0.5, "c": 0.75, "d": 0.25}, 1.0, 0.0, 0.4
    )
    summary = {"steps": 10, "elapsed_s": 60.0, "checkpoint": "ck"}
    report = demo_report(before, after, summary, tmp_path)
    # sampled d = (0.5, 0.25, 0.25, 0.25): mean 0.3125, sample variance (3·0.0625² + 0.1875²)/3 = 0.015625,
    # SE = sqrt(0.015625 / 4) = 0.0625
    assert report["sampled"] == {
        "samples": 4,
        "success_before": 0.1875,
        "success_after": 0.5,
        "gain": 0.3125,
        "gain_paired_se": 0.0625,
    }
    assert report["answers_before"] == {"f1": 0.1, "answered": 0.5, "malformed": 0.25}
    assert report["answers_after"] == {"f1": 0.4, "answered": 1.0, "malformed": 0.0}
    md = render_markdown({**report, "wall_s": 90.0})
    assert "1.5 min from start to end.\n" in md  # a report without a commit (written before they had one)
    assert "(temperature 1, 4 per question): 0.188 before → 0.500 after, +0.312 ± 0.062" in md
    assert "(paired over questions; 5.0 SE)" in md
    assert "answered 0.50 → 1.00, malformed 0.25 → 0.00, F1 0.100 → 0.400" in md
