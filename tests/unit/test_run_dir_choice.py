"""`treeopsd train` without a chosen run directory: each fresh run its own runs/<name>-<time>, --resume the
newest of them (launch/cmd_train.py `choose_run_dir`)."""

from launch.cmd_train import UNCHOSEN_RUN_DIR, choose_run_dir


def test_fresh_runs_get_their_own_directory_and_resume_finds_the_newest(tmp_path):
    unchosen = str(tmp_path / "default")  # the same rule, with runs/ under tmp_path
    first = choose_run_dir(unchosen, "default", False, False, "20261204-101500", unchosen)
    assert first == str(tmp_path / "default-20261204-101500")
    for stamp in ("20261204-101500", "20261204-113000"):
        (tmp_path / f"default-{stamp}").mkdir()
        (tmp_path / f"default-{stamp}" / "config.yaml").write_text("run: {}\n")
    (tmp_path / "default-20261204-120000").mkdir()  # no config.yaml: never started, not a run
    newest = choose_run_dir(unchosen, "default", False, True, "x", unchosen)
    assert newest == str(tmp_path / "default-20261204-113000")
    assert choose_run_dir(unchosen, "other", False, True, "x", unchosen) == unchosen  # none of that name


def test_a_chosen_directory_is_kept():
    assert choose_run_dir("runs/mine", "default", False, False, "s") == "runs/mine"
    assert (
        choose_run_dir(UNCHOSEN_RUN_DIR, "default", True, False, "s") == UNCHOSEN_RUN_DIR
    )  # --run-dir given
    assert choose_run_dir(UNCHOSEN_RUN_DIR, "exp", False, False, "s") == "runs/exp-s"
