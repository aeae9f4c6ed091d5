"""An interrupted experiment run (no result.json) starts over: its half-filled store would block admission."""

from launch.cmd_experiment import clear_interrupted


def test_an_interrupted_run_directory_is_removed(tmp_path):
    folder = tmp_path / "t1-s0-w0"
    (folder / "run" / "store" / "segments").mkdir(parents=True)
    (folder / "run" / "store" / "segments" / "000001.arrow").write_bytes(b"partial")
    (folder / "log.txt").write_text("killed\n")
    assert clear_interrupted(folder) is True
    assert not (folder / "run").exists() and (folder / "log.txt").exists()  # only the run directory goes
    assert clear_interrupted(folder) is False  # nothing left to clear


def test_a_finished_run_is_kept(tmp_path):
    folder = tmp_path / "t2-s0-w0"
    (folder / "run" / "store").mkdir(parents=True)
    (folder / "result.json").write_text("{}")
    assert clear_interrupted(folder) is False
    assert (folder / "run" / "store").is_dir()
