"""The metrics line a run prints every `logging.log_every` steps when it shows no progress bar."""

from configs.schema import parse_config
from runtime.progress import step_line


def test_step_line_by_hand():
    line = step_line({"reward/mean": 0.25, "learner/loss": 0.00314, "learner/step_s": 1.456}, 20, 200)
    assert line == "step 20/200: reward 0.250, loss 0.0031, learner 1.46 s/step"
    assert (
        step_line({}, 3, 3) == "step 3/3: reward nan, loss nan, learner nan s/step"
    )  # a step with no batch stats


def test_log_every_is_a_positive_integer():
    assert parse_config({}).logging.log_every == 1
    assert parse_config({}, ["logging.log_every=20"]).logging.log_every == 20
