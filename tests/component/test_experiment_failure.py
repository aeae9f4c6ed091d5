"""`treeopsd experiment` with one run that fails at run time (docs/testing.md: "Experiments: rows validated
first, finished runs kept, a failed run reported").

The grid (one seed, 3 runs) validates, then one training run fails in its own process the way a user can
really make it fail: its row points `store.dir` at an existing folder that holds someone else's file, which
the replay store refuses (storage/store_files.py `init_or_check`) when the run builds it. Proven here:
the command exits 1 and names the failed run with its error (stderr, stdout, the JSON's "failed" map, the
markdown); the other two runs finish and are reported; the failed row stays in the table with 0 seeds.
After the user empties the folder, the same command again reuses the 2 finished runs (their result.json
untouched), runs only the failed one, succeeds and exits 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from experiments.grid import load_spec, plan
from launch.cli import main
from tests.component.test_experiment_run import tiny_spec

STORE_REFUSAL = "not a treeopsd replay store (no treeopsd-store.json); refusing a non-empty directory"


def failing_spec(tiny_model_dir: str, store_dir: Path) -> dict:
    """tests/component/test_experiment_run.py's tiny grid at one seed, without its rho row; row (2,2) keeps
    its replay store in `store_dir` (store.* is not part of a run's key, so the key does not depend on where
    the store lives)."""
    spec = tiny_spec(tiny_model_dir)
    rows = {r["name"]: r for r in spec["rows"]}
    alloc = rows["(2,2)"]
    alloc["set"] = {**alloc["set"], "store.dir": str(store_dir)}
    return {**spec, "seeds": [0], "rows": [rows["ReAct"], rows["TreeOPSD (4,2)"], alloc]}


def check_first_attempt(out: Path, runs: Path, keys: dict[str, str], store_dir: Path, capsys) -> str:
    """The grid with the failing run: exit 1 already asserted by the caller; returns the error text."""
    bad = keys["(2,2)"]
    log = runs / bad / "log.txt"
    error = f"exit 1: storage.store_files.StoreError: {store_dir}: {STORE_REFUSAL} (log: {log})"
    captured = capsys.readouterr()
    assert "experiment tiny: 3 runs, 0 already done, 2 at a time" in captured.err
    assert f"{bad} seed 0 ((2,2)): FAILED {error}\n" in captured.err
    for row in ("ReAct", "TreeOPSD (4,2)"):
        assert f"{keys[row]} seed 0 ({row}): success " in captured.err
    assert f"\n- failed: {bad}: {error}" in captured.out  # the printed report names it too

    data = json.loads((out / "tiny.json").read_text())
    assert data["failed"] == {bad: error}
    assert sorted(data["runs"]) == sorted([keys["ReAct"], keys["TreeOPSD (4,2)"]])
    assert all(r["eval"]["n"] == 4 for r in data["runs"].values())
    rows = {r["row"]: r for r in data["rows"]}
    assert [rows[n]["seeds"] for n in ("ReAct", "TreeOPSD (4,2)", "(2,2)")] == [[0], [0], []]
    assert rows["(2,2)"]["cost"] == 0.0 and rows["(2,2)"]["success"] == [None, None]
    assert data["claims"][0]["seeds"] == 1  # the claim's rows both finished

    table = (out / "tiny.md").read_text()
    assert "| main | TreeOPSD (4,2) | 8 | 1 |" in table and "| main | ReAct | — | 1 |" in table
    assert "| allocation | (2,2) | — | 0 | — | — | — |" in table  # still listed, without numbers
    assert f"\n- failed: {bad}: {error}\n" in table and "![curves](tiny_curves.png)" in table
    assert (out / "tiny_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert not (runs / bad / "result.json").exists()
    assert f"StoreError: {store_dir}: {STORE_REFUSAL}" in log.read_text()  # the traceback is kept
    (first,) = json.loads((runs / "history.json").read_text())
    assert first["runs"] == 2 and first["jobs"] == 2  # the failed run is not counted as executed
    return error


def check_second_attempt(out: Path, runs: Path, keys: dict[str, str], capsys) -> None:
    """The rerun after the fix: only the failed run ran, and it finished."""
    bad = keys["(2,2)"]
    err = capsys.readouterr().err
    assert "experiment tiny: 3 runs, 2 already done, 2 at a time" in err
    assert f"[1/1] {bad} seed 0 ((2,2)): success " in err  # the only run executed
    assert "FAILED" not in err
    data = json.loads((out / "tiny.json").read_text())
    assert data["failed"] == {}
    assert sorted(data["runs"]) == sorted(keys.values())
    retried = data["runs"][bad]
    assert retried["steps"] == 2 and len(retried["curves"]["reward/mean"]) == 2
    assert retried["model"].startswith(str(runs / bad))
    rows = {r["row"]: r for r in data["rows"]}
    assert all(r["seeds"] == [0] for r in rows.values())
    assert rows["(2,2)"]["cost"] == 4.0  # 2 * (1 + 2/2)
    table = (out / "tiny.md").read_text()
    assert "| allocation | (2,2) | 4 | 1 |" in table and "- failed:" not in table
    first, second = json.loads((runs / "history.json").read_text())
    assert (first["runs"], second["runs"]) == (2, 1)
    assert data["provenance"]["executed_by"] == [first, second]


def test_failed_run_is_reported_others_kept_and_rerun_retries_only_it(tmp_path, tiny_model_dir, capsys):
    store_dir = tmp_path / "shared-folder"  # a folder the user already keeps something in
    store_dir.mkdir()
    (store_dir / "notes.txt").write_text("not a replay store\n")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(failing_spec(tiny_model_dir, store_dir)))
    keys = {r.rows[0]: r.key for r in plan(load_spec(path))}
    assert sorted(keys) == ["(2,2)", "ReAct", "TreeOPSD (4,2)"] and len(set(keys.values())) == 3
    out, runs = tmp_path / "out", tmp_path / "runs"
    # --allow-dirty: the suite runs on working trees too; the refusal itself: test_experiment_spec.py
    argv = [
        "experiment",
        str(path),
        "--out",
        str(out),
        "--runs-dir",
        str(runs),
        "--jobs",
        "2",
        "--allow-dirty",
    ]
    argv += ["--models-dir", str(tmp_path / "models")]

    assert main(argv) == 1  # the spec validated (not 2); a run failed
    error = check_first_attempt(out, runs, keys, store_dir, capsys)
    kept = {k: (runs / k / "result.json") for k in (keys["ReAct"], keys["TreeOPSD (4,2)"])}
    before = {k: (p.read_bytes(), p.stat().st_mtime_ns) for k, p in kept.items()}

    assert main(argv) == 1  # nothing changed: the finished runs are reused, the failed one fails again
    err = capsys.readouterr().err
    assert "experiment tiny: 3 runs, 2 already done, 2 at a time" in err
    assert f"[1/1] {keys['(2,2)']} seed 0 ((2,2)): FAILED {error}\n" in err
    assert json.loads((out / "tiny.json").read_text())["failed"] == {keys["(2,2)"]: error}

    (store_dir / "notes.txt").unlink()  # the user's fix: the store may now use the (empty) folder
    assert main(argv) == 0
    check_second_attempt(out, runs, keys, capsys)
    assert {k: (p.read_bytes(), p.stat().st_mtime_ns) for k, p in kept.items()} == before
    assert (store_dir / "treeopsd-store.json").is_file()  # the retried run's store lives there now
