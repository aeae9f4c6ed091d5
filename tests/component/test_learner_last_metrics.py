"""A learner step whose call fails after the step was applied (the store lost while the new version is
announced) keeps that step's metrics, batch index included: the driver logs them when it re-syncs
(runtime/supervision.py), so the learner's metrics name every trained batch."""

import numpy as np
import pytest
from learner_fixtures import config, make_trees

from actors.policy.tiny_model import build_tiny_model
from learner.learner import Learner


class Store:
    """Batches of 2 in order; `set_learner_version` fails once `down` is set (the store actor restarting)."""

    def __init__(self, trees):
        self.trees, self.k, self.down = trees, 0, False

    def watermark(self):
        return self.k

    def take_batch(self, n):
        batch, self.k = self.trees[self.k * n : (self.k + 1) * n], self.k + 1
        return batch

    def set_learner_version(self, version):
        if self.down:
            raise ConnectionError("the store went away")


def test_a_step_whose_call_failed_after_training_keeps_its_metrics(tok):
    store = Store(make_trees(tok, n=4))
    learner = Learner(build_tiny_model(tok, seed=0), config(learner={"batch_trees": 2}), store=store)
    assert learner.last_step_metrics() is None  # nothing trained yet
    first = learner.train_step()
    assert learner.last_step_metrics() is first and first["learner/batch_index"] == 0.0
    store.down = True
    with pytest.raises(ConnectionError, match="the store went away"):
        learner.train_step()  # batch 1 was trained, then announcing version 2 failed
    kept = learner.last_step_metrics()
    assert learner.version == 2 and kept is not first
    assert (kept["learner/version"], kept["learner/step"], kept["learner/batch_index"]) == (2.0, 2.0, 1.0)
    assert np.isfinite(kept["learner/loss"]) and kept["learner/trees"] == 2


def test_a_learner_restored_from_its_checkpoint_has_that_steps_metrics(tok, tmp_path):
    """A learner SIGKILLed after saving step k, before its call returned: the restarted one, restored from
    step k, still names k's batch, so the driver logs it (the 16-step drill once found batch 8 trained,
    in the checkpoint, and in no metrics)."""
    run = {"run_dir": str(tmp_path)}
    cfg = config(learner={"batch_trees": 2, "checkpoint_every": 1}, run=run)
    store = Store(make_trees(tok, n=4))
    learner = Learner(build_tiny_model(tok, seed=0), cfg, store=store)
    learner.train_step()
    second = learner.train_step()  # batch 1, saved as step 2
    again = Learner(build_tiny_model(tok, seed=1), cfg, store=store)  # the restart, before restoring
    assert again.last_step_metrics() is None
    assert again.restore(tmp_path) is not None and again.version == 2
    kept = again.last_step_metrics()
    assert kept is not None and (kept["learner/version"], kept["learner/batch_index"]) == (2.0, 1.0)
    assert kept["learner/loss"] == second["learner/loss"]  # JSON keeps a float64 exactly
    assert set(kept) <= set(second)  # what the step had measured when it was saved
