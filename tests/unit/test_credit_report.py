"""The credit report (benchmarks/credit_report.py): verdicts read off the paired interval, every row."""

from benchmarks.credit_report import render, verdict


def fig(diff, lo, hi, trees=10):
    out = {"trees": trees, "treeopsd_minus_grpo": diff, "treeopsd_minus_grpo_lo": lo}
    out["treeopsd_minus_grpo_hi"] = hi
    for m, v in (("treeopsd", 0.74), ("grpo", 0.73), ("treepo", 0.72)):
        out.update({f"credit_auc_{m}": v, f"credit_auc_{m}_lo": v - 0.01, f"credit_auc_{m}_hi": v + 0.01})
    return out


def test_verdict_follows_the_interval():
    assert verdict(fig(0.008, 0.005, 0.011)) == "TreeOPSD better (interval above 0)"
    assert verdict(fig(-0.008, -0.011, -0.005)) == "TreeOPSD worse (interval below 0)"
    assert verdict(fig(0.001, -0.002, 0.004)) == "within noise (interval contains 0)"
    assert verdict({"treeopsd_minus_grpo": 0.1}) == "no interval"


def test_render_has_a_row_per_shape_and_hop_count():
    credit = {
        **fig(0.008, 0.005, 0.011, trees=90),
        "trees_per_setting": 10,
        "shapes": ["4,2", "8,0"],
        "hops": [2, 4],
        "turns": 900,
        "progress_turns": 300,
        "rho": 0.25,
        "seed": 0,
        "n_boot": 1000,
        "by_shape": {"4,2": fig(0.017, 0.01, 0.02), "8,0": fig(0.0, 0.0, 0.0)},
        "by_hops": {"2": fig(0.002, -0.01, 0.01)},
    }
    text = render(credit)
    assert (
        "| all (pooled) | 90 | 0.740 [0.730, 0.750] | 0.730 [0.720, 0.740] | 0.720 [0.710, 0.730] | "
        "+0.008 [0.005, 0.011] | TreeOPSD better (interval above 0) |" in text
    )
    assert "| (M, N) = (8,0) | 10 |" in text and "| 2-hop questions | 10 |" in text
    assert text.count("\n| ") == 1 + 1 + 3  # the header, the pooled row, 2 shapes + 1 hop count
