"""The off-policy table's statistics (experiments/drift_report.py, experiments/drift_measure.py's estimator)
and its markdown (experiments/drift_render.py), on hand-made cells."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.drift_measure import unbiased_sq_norm
from experiments.drift_render import render
from experiments.drift_report import bucket_of, bucket_table, qualifying


def test_unbiased_sq_norm_is_the_mean_of_cross_products():
    # rows (1, 0), (3, 0): ‖Σ‖² = 16, Σ‖v‖² = 10, (16 − 10) / (2 · 1) = 3 = v₁·v₂ (the only pair)
    assert unbiased_sq_norm(np.array([[1.0, 0.0], [3.0, 0.0]])) == 3.0
    # pure noise around 0: the estimate of ‖E v‖² = 0 is centred on 0 (the plain ‖mean‖² would be ≈ 50/n)
    rng = np.random.default_rng(0)
    estimates = [unbiased_sq_norm(rng.normal(size=(20, 50))) for _ in range(400)]
    assert abs(np.mean(estimates)) < 0.05 and min(estimates) < 0  # negative estimates are kept


def test_buckets_are_the_issue_s_edges():
    assert [bucket_of(x) for x in (0.0, 0.1, 0.11, 0.3, 0.5, 1.0, 1.2)] == [
        "≤ 0.1", "≤ 0.1", "0.1–0.3", "0.1–0.3", "0.3–1", "0.3–1", "> 1",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not a number"):
        bucket_of(math.nan)


CELLS = [  # two cells in 0.1–0.3 and one above 1; cosines of three μ batches per mode
    {"name": "a", "turn_kl": 0.2, "cosine": {"none": [0.9, 0.8, 0.7], "token_tis": [0.91, 0.8, 0.72]}},
    {"name": "b", "turn_kl": 0.25, "cosine": {"none": [0.6, 0.6, 0.6], "token_tis": [0.6, 0.61, 0.6]}},
    {"name": "c", "turn_kl": 2.0, "cosine": {"none": [0.5, 0.4, 0.6], "token_tis": [0.2, 0.1, 0.3]}},
]


def test_bucket_table_pools_batches_and_pairs_modes():
    table = bucket_table(CELLS)
    assert [b["bucket"] for b in table] == ["0.1–0.3", "> 1"] and table[0]["cells"] == ["a", "b"]
    low = {r["mode"]: r for r in table[0]["modes"]}
    # pooled: none (0.9+0.8+0.7+0.6·3)/6 = 0.7, token_tis (0.91+0.8+0.72+0.6+0.61+0.6)/6 = 0.70667: best
    assert low["none"]["cosine"] == pytest.approx(0.7) and table[0]["best"] == "token_tis"
    assert low["token_tis"]["vs_best"] is None and low["none"]["qualifies"]
    # none − token_tis per batch: −0.01, 0, −0.02, 0, −0.01, 0 → mean −0.00667, paired over 6 batches
    assert low["none"]["vs_best"]["mean"] == pytest.approx(-0.04 / 6) and low["none"]["vs_best"]["df"] == 5
    high = {r["mode"]: r for r in table[1]["modes"]}
    # above 1: token_tis 0.2 vs none 0.5, 0.3 below the best: outside 0.02
    assert table[1]["best"] == "none" and not high["token_tis"]["qualifies"]
    assert high["token_tis"]["vs_best"]["verdict"] == "reversed"  # −0.3 each batch: t = −∞, p = 0
    assert qualifying(table) == ["none"]


def test_render_names_the_claim_and_says_whether_it_holds():
    table = bucket_table(CELLS)
    results = {
        "spec": "configs/offpolicy_table.yaml", "quick": False, "commit": "abc1234", "clean": True,
        "note": "",
        "date": "2026-12-06 12:00 UTC", "cpus": 2, "cpu": "x", "wall_s": 60.0, "auto": "token_tis",
        "drift": {"trees_per_batch": 8, "lags": [1], "chain_steps": 4, "think_tokens": [64], "batches": 3},
        "buckets": {"synthetic": table, "tiny_model": table},
        "qualifying": {"synthetic": ["none"], "tiny_model": ["none"]},
        "cells": {"tiny_model": [{"name": "L=64, η=1", "tokens_per_turn": 70.0, "turn_kl": 0.2}]},
    }  # fmt: skip
    md = render(results)
    assert "commit abc1234, 2026-12-06" in md and "`auto` — `token_tis` — is within 0.02" in md
    assert "so the claim for `token_tis` does not hold there" in md
    assert "token_tis's in bucket > 1: 0.300 below the best" in md
    assert "| > 1 | c (2.00) | token_tis | 0.200 | — | -0.3000" in md
    # its one shortfall (> 1, −0.3 in every batch: se 0, p 0) is named with its test
    assert "`token_tis` falls short in 1 bucket(s) (> 1: -0.300 ± 0.000 (p = 0.000, " in md
    assert "1 of them significant at 5 %." in md
    again = render({**results, "rerendered": {"commit": "def5678", "clean": True, "note": "", "date": "d2"}})
    assert "60 CPUs" not in again and "1.0 min wall. Re-rendered at commit def5678, d2." in again
