"""The learner's per-turn record (learner/turn_record.py) and the student's KL the viewer computes from it
(system/teacher.py `student_kl`), against hand-worked values and the learner's own loss."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from learner.losses import treeopsd_loss
from learner.turn_record import SCHEMA, TurnRecorder, turn_row
from system.teacher import student_kl


def test_turn_row_hand_worked():
    # tokens 0..3; token 2 has no finite reference (left out of s and ℓ), token 3 weighs 3 (correction c)
    logp = np.array([-1.0, -2.0, -0.5, -1.0], np.float32)
    ref = np.array([-1.5, -1.0, np.nan, -2.0], np.float32)
    mu = np.array([-1.5, -1.0, -0.5, -2.0], np.float32)
    row = turn_row("t", 3, np.arange(4), logp, ref, mu, np.array([1.0, 1.0, 1.0, 3.0]))
    # d = logp − ref = (0.5, −1, ·, 1); s = (1·0.5 + 1·(−1) + 3·1) / (1 + 1 + 3) = 2.5 / 5 = 0.5
    assert row["ell"] == 3 and row["mass"] == 5.0 and row["s"] == pytest.approx(0.5, abs=1e-12)
    # k3 = e^g − 1 − g over g = logp − μ = (0.5, −1, 0, 1): all four finite
    g = np.array([0.5, -1.0, 0.0, 1.0])
    assert row["k3_n"] == 4 and row["k3_sum"] == pytest.approx(float(np.sum(np.expm1(g) - g)), rel=1e-6)
    assert row["offsets"] == [0, 1, 2, 3] and row["logp"] == pytest.approx(logp.tolist())


def test_student_kl_is_the_losses_kl():
    rng = np.random.default_rng(0)
    q = np.concatenate([rng.uniform(0.05, 0.95, 50), [0.0, 1.0, 0.5]])
    s = np.concatenate([rng.normal(0, 3, 50), [2.0, -2.0, 0.0]])
    ours = student_kl(q, s)
    for qi, si, k in zip(q, s, ours, strict=True):  # one turn of one token each: loss = KL exactly
        loss, _ = treeopsd_loss(
            torch.tensor([si], dtype=torch.float64),
            torch.zeros(1, dtype=torch.float64),
            torch.zeros(1, dtype=torch.long),
            torch.tensor([qi], dtype=torch.float64),
        )
        assert k == pytest.approx(float(loss), abs=1e-12)
    # hand-worked: q = 0.75 at s = 0: 0.75 ln 0.75 + 0.25 ln 0.25 + ln 2 = 0.130812
    assert float(student_kl(0.75, 0.0)) == pytest.approx(
        0.75 * math.log(0.75) + 0.25 * math.log(0.25) + math.log(2), abs=1e-12
    )
    assert float(student_kl(0.5, 0.0)) == 0.0 and math.isfinite(float(student_kl(0.3, 800.0)))


def test_recorder_writes_one_file_per_batch_or_none(tmp_path):
    rec = TurnRecorder(tmp_path, batch=7, version=6, rank=1)
    assert rec.write() is None and not (tmp_path / "learner_turns").exists()
    rec.rows.append(
        {
            **turn_row(
                "t",
                1,
                np.arange(1),
                np.zeros(1, np.float32),
                np.zeros(1, np.float32),
                np.zeros(1, np.float32),
                np.ones(1),
            ),
            "batch": 7,
            "version": 6,
            "minibatch": 0,
            "z": 1.0,
        }
    )
    path = rec.write()
    assert path == tmp_path / "learner_turns" / "batch_000007.rank1.arrow"
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    assert table.schema.equals(SCHEMA) and table.column("tree_id").to_pylist() == ["t"]
