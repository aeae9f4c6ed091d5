"""The fault-tolerance block of docs/results.md (tools/fault_report.py) is rendered from the soak's and the
drill's reports: every figure in it comes from those files."""

import json

from tools.fault_report import publish, render

SOAK = {
    "ok": True,
    "minutes": 30.0,
    "every": 30.0,
    "seed": 0,
    "steps": 412,
    "store": {
        "trees_committed": 900,
        "trees_lost": 0,
        "trees_duplicated": 0,
        "trees_half_visible": 0,
        "interrupted_commits": 3,
        "batches": 412,
    },
    "batches_trained_twice": [],
    "batches_skipped": [],
    "batches_handed_out_not_trained": 0,
    "kills": {"sampler": 2, "store": 1},
    "kill_log": [[30.1, "sampler", 1], [60.2, "store", 2], [90.4, "sampler", 3]],
    "restarts": {"store": 1, "sampler": 2},
    "memory_warmup_s": 120.0,
    "memory_window_s": 300.0,
    "memory": {
        "store": {
            "processes": 2,
            "measured": 1,
            "longest_lived_s": 1700.4,
            "rss_mb": 310.2,
            "max_slope_mb_per_min": 0.25,
        },
        "sampler": {
            "processes": 3,
            "measured": 0,
            "longest_lived_s": 20.0,
            "rss_mb": 500.0,
            "max_slope_mb_per_min": None,
        },
    },
}
DRILL = {
    "steps": 300,
    "kills": [[17, "store", 5], [120, "learner", 6]],
    "wall_s": 1234.4,
    "checks": {"exit_0": True, "store_verify_clean": False},
    "steps_trained": 300,
    "store_batches": 300,
    "restarts": {"store": 1, "learner": 1},
    "store_verify": ["ok: 1 trees"],
}


def test_soak_and_drill_figures_come_from_their_reports(tmp_path):
    publish(SOAK, "soak.json", tmp_path)
    md = publish(DRILL, "drill.json", tmp_path).read_text()
    assert json.loads((tmp_path / "drill.json").read_text()) == DRILL
    # 3 kills at 30.1, 60.2, 90.4 s: gaps 30.1 and 30.2, median 30.15 → "30 s"; 2 sampler + 1 store
    assert (
        "412 learner steps in 30 minutes under 3 SIGKILLs, one every 30 s (median) — sampler 2, store 1."
        in md
    )
    assert "`treeopsd soak --minutes 30 --every 30 --seed 0`" in md
    assert "| trees lost / duplicated / half-visible | 0 / 0 / 0 |" in md
    assert "after its first 120 s, over processes watched at least 300 s past that" in md
    assert "| store | 2 | 1 | 1700 | 310 | 0.250 | yes |" in md
    assert "| sampler | 3 | 0 | 20 | 500 | — | — |" in md  # no slope: no process lived past the window
    assert "store at step 17, learner at step 120; 1234 s in all." in md
    assert "| exit 0 | yes |" in md and "| store verify clean | **no** |" in md
    assert render(tmp_path) == md
