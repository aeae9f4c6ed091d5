"""Graceful interrupts (runtime/signals.py): the first SIGINT/SIGTERM only asks for a stop, the second raises
Abort with the shell's exit code (128 + the signal number); the previous handlers come back afterwards."""

from __future__ import annotations

import io
import os
import signal

import pytest

from runtime.signals import Abort, GracefulStop


def test_first_signal_asks_for_a_stop_and_the_second_aborts_with_128_plus_its_number():
    before = signal.getsignal(signal.SIGINT)
    stream = io.StringIO()
    with GracefulStop(stream) as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next bytecode of the main thread
        assert stop.requested() and stop.name() == "SIGINT"
        assert "stopping after the current learner step" in stream.getvalue()
        with pytest.raises(Abort) as e:
            os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.exit_code == 128 + signal.SIGTERM == 143
    assert str(e.value) == "stopped at once by a second SIGTERM"
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_abort_is_not_swallowed_by_except_exception():
    assert not issubclass(Abort, Exception)
    assert Abort(signal.SIGINT).exit_code == 130
