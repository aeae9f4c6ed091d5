"""`treeopsd experiment SPEC`: the paper's comparison grid at small scale (`make paper-table`).

    treeopsd experiment configs/paper_table.yaml            # every row x 3 seeds; docs/results.md: its time
    treeopsd experiment configs/paper_table.yaml --quick    # the spec's `quick` settings (fits 20 minutes)
    treeopsd experiment SPEC --dry-run                      # the plan: runs, rows sharing them, costs

Phases: warm-start the tiny model once per seed (cached) → every distinct (config, seed) run, `--jobs` at
a time, each in a fresh process (`python -m experiments.run`: JSON in and out, its log beside its
result) → the table and curves. Runs live in `--runs-dir` (default runs/experiments/<name>[-quick]/<key>/);
a run with a result.json is not run again, so an interrupted grid resumes. Writes into `--out` (default
benchmarks/results/): <name>[_quick].md (table + provenance), <name>[_quick].json (every run's numbers) and
<name>[_quick]_curves.png.
A failed run is reported and left out of its row (the row shows fewer seeds); exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from storage.durable import write_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="experiment spec (configs/paper_table.yaml)")
    parser.add_argument("--quick", action="store_true", help="use the spec's quick settings")
    parser.add_argument("--jobs", type=int, default=None, help="runs at once (default: CPU count)")
    parser.add_argument("--out", default="benchmarks/results", help="where the table and curves go")
    parser.add_argument("--runs-dir", default=None, help="default runs/experiments/<name>[-quick]")
    parser.add_argument("--models-dir", default="runs/models", help="warm-started model cache")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument(
        "--allow-dirty", action="store_true", help="run from uncommitted code (the results then say so)"
    )
    parser.add_argument(
        "--rerender",
        action="store_true",
        help="runs nothing: the table of --out's <name>.json again, with the current statistics",
    )


def run(args: argparse.Namespace) -> int:
    from experiments.grid import ExperimentSpecError, load_spec, plan

    try:
        spec = load_spec(args.spec, args.quick)
        runs = plan(spec)
    except ExperimentSpecError as e:
        print(f"treeopsd experiment: {e}", file=sys.stderr)
        return 2
    tag = f"{spec.name}{'_quick' if spec.quick else ''}"
    runs_dir = Path(args.runs_dir or f"runs/experiments/{tag.replace('_quick', '-quick')}")
    if args.dry_run:
        for r in runs:
            print(f"{r.key}  seed {r.seed}  {'train+eval' if r.train else 'eval'}  rows: {', '.join(r.rows)}")
        print(
            f"{len(runs)} runs for {len(spec.rows)} rows x {len(spec.seeds)} seeds, {spec.steps} steps each"
        )
        return 0
    from experiments.provenance import DirtyTree, require_clean

    try:
        stamp = require_clean(args.allow_dirty)  # before anything runs: hours later is too late to refuse
    except DirtyTree as e:
        print(f"treeopsd experiment: {e}", file=sys.stderr)
        return 2
    if args.rerender:
        return _rerender(spec, tag, Path(args.out), stamp)
    jobs = max(1, args.jobs or os.cpu_count() or 1)
    prov, t0 = {**_provenance(jobs), **stamp}, time.time()  # the code that runs is the code at the start
    results, failed, executed = _execute(spec, runs, runs_dir, Path(args.models_dir), jobs)
    prov["wall_s"] = round(time.time() - t0, 1)
    prov["executed_by"] = _history(runs_dir, prov, executed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write_outputs(spec, tag, results, failed, out, prov)
    return 1 if failed else 0


def _rerender(spec: Any, tag: str, out: Path, stamp: dict[str, Any]) -> int:
    """The table and claims of an earlier run's results file, recomputed from its runs (their numbers as
    they were written) with today's statistics; the runs' own provenance (`executed_by`) is kept."""
    from experiments import provenance

    path = out / f"{tag}.json"
    try:
        data = json.loads(path.read_text())
        results, failed, prov = _nan_back(data["runs"]), data["failed"], data["provenance"]
    except (OSError, ValueError, KeyError) as e:
        print(f"treeopsd experiment: --rerender needs {path} from an earlier run ({e})", file=sys.stderr)
        return 2
    prov = {**prov, **stamp, "date": provenance.now(), "rerendered": True}
    _write_outputs(spec, tag, results, failed, out, prov)
    return 0


def _nan_back(x: Any) -> Any:
    """JSON's nulls (written for NaN by _no_nan) as NaN again."""
    if isinstance(x, dict):
        return {k: _nan_back(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_back(v) for v in x]
    return math.nan if x is None else x


def _child(args: list[str], log: Path) -> str:
    """Runs `python -m experiments.run ARGS` (JSON on the command line and in files, never pickle);
    its stderr goes to `log`; returns its stdout. A crash or non-zero exit raises naming the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.run", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"exit {proc.returncode}: {tail[0]} (log: {log})")
    return proc.stdout


def clear_interrupted(folder: Path) -> bool:
    """Removes the run directory an interrupted run left (it has no result.json): its store holds the trees
    and reservations of the killed process, so reopening it would block admission; the run, seeded, starts
    over from nothing. True when something was removed."""
    run_dir = folder / "run"
    if (folder / "result.json").is_file() or not run_dir.exists():
        return False
    shutil.rmtree(run_dir)
    print(f"experiment: {folder.name} was interrupted before; starting it over", file=sys.stderr)
    return True


def _execute(spec: Any, runs: list[Any], runs_dir: Path, models_dir: Path, jobs: int):
    from dataclasses import asdict

    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    todo = []
    for r in runs:
        done = runs_dir / r.key / "result.json"
        if done.is_file():
            results[r.key] = {**json.loads(done.read_text()), "rows": list(r.rows)}
        else:
            todo.append(r)
    print(
        f"experiment {spec.name}: {len(runs)} runs, {len(results)} already done, {jobs} at a time",
        file=sys.stderr,
    )
    if not todo:
        return results, failed, 0
    quick = "1" if spec.quick else "0"
    with ThreadPoolExecutor(jobs) as pool:  # each thread waits on one child process
        model_for = _warm_starts(spec, todo, runs_dir, models_dir, pool)
        pending: dict[Future[str], Any] = {}
        for r in todo:
            folder = runs_dir / r.key
            clear_interrupted(folder)
            args = [
                "run",
                spec.path,
                quick,
                json.dumps(asdict(r)),
                model_for[r.key],
                str(folder),
            ]
            pending[pool.submit(_child, args, folder / "log.txt")] = r
        for n, fut in enumerate(as_completed(pending), 1):
            r = pending[fut]
            try:
                fut.result()
                res = json.loads((runs_dir / r.key / "result.json").read_text())
                results[r.key] = {**res, "rows": list(r.rows)}
                msg = f"success {res['eval']['success']:.3f}"
            except (RuntimeError, OSError, ValueError) as e:  # one bad run must not lose the others
                failed[r.key] = str(e)
                msg = f"FAILED {failed[r.key]}"
            print(f"[{n}/{len(todo)}] {r.key} seed {r.seed} ({'; '.join(r.rows)}): {msg}", file=sys.stderr)
    return results, failed, len(todo) - len(failed)


def _warm_starts(spec: Any, todo: list[Any], runs_dir: Path, models_dir: Path, pool: Any) -> dict[str, str]:
    """Each run's start model: one warm start per distinct (model seed, `grid.warm_key`), in parallel,
    named by the first row that needs it (cached in models_dir); returns run key -> model path."""
    from experiments.grid import warm_key

    quick = "1" if spec.quick else "0"
    rows = {row.name: row for row in spec.rows}
    needs: dict[tuple[int, str], str] = {}  # (model seed, warm key) -> the first row that needs it
    run_start: dict[str, tuple[int, str]] = {}
    for r in todo:
        seed = spec.model_seed(r.seed)
        start = (seed, warm_key(spec, rows[r.rows[0]], r.seed))
        needs.setdefault(start, r.rows[0])
        run_start[r.key] = start
    futures = {}
    for i, (start, row) in enumerate(needs.items()):
        seed = start[0]
        log = runs_dir / (f"warm-s{seed}.log" if i == 0 else f"warm-s{seed}-{i}.log")
        args = ["warm", spec.path, quick, str(seed), str(models_dir), row]
        futures[start] = pool.submit(_child, args, log)
    model = {start: json.loads(f.result().splitlines()[-1])["model"] for start, f in futures.items()}
    return {key: model[start] for key, start in run_start.items()}


def _history(runs_dir: Path, prov: dict[str, Any], executed: int) -> list[dict[str, Any]]:
    """runs_dir/history.json: every invocation that ran something (commit, date, runs, wall time), so a
    table rendered later from cached runs still says which code produced them."""
    from experiments.provenance import write_json

    path = runs_dir / "history.json"
    history = json.loads(path.read_text()) if path.is_file() else []
    if executed:
        keys = ("commit", "date", "wall_s", "jobs")
        history.append({**{k: prov[k] for k in keys}, "runs": executed})
        runs_dir.mkdir(parents=True, exist_ok=True)
        write_json(path, history)
    return history


def _provenance(jobs: int) -> dict[str, Any]:
    from experiments import provenance

    return {
        "commit": provenance.commit(),
        "cpus": os.cpu_count(),
        "cpu": provenance.cpu_model(),
        "python": platform.python_version(),
        "jobs": jobs,
        "date": provenance.now(),
    }


def _write_outputs(spec, tag, results, failed, out: Path, prov: dict[str, Any]) -> None:
    ran = "; ".join(
        f"commit {h['commit']} from {h['date']} ({h['runs']} runs, {h['wall_s'] / 60:.1f} min wall, "
        f"{h['jobs']} at a time)"
        for h in prov["executed_by"]
    )
    from experiments.plot import plot_curves
    from experiments.report import best_per_group, render_best, render_table, rows_summary

    summary = rows_summary(spec, results)
    png = out / f"{tag}_curves.png"
    plot_curves(spec, results, summary, png)
    n_eval = max((r["eval"]["n"] for r in results.values() if "eval" in r), default=0)
    ablation = "" if spec.ablation_seeds is None else f" (ablation rows: seeds {list(spec.ablation_seeds)})"
    head = (
        f"# {spec.name}{' (--quick)' if spec.quick else ''}\n\n"
        f"`treeopsd experiment {spec.path}{' --quick' if spec.quick else ''}` — seeds "
        f"{list(spec.seeds)}{ablation}, {spec.steps} learner steps per run, evaluated on {n_eval} held-out "
        f"questions (greedy, and {spec.samples} samples each at temperature 1), mean ± standard error over "
        f"seeds.\n\n"
        f"Runs executed by {ran or 'nothing'}. Table {'re-' if prov.get('rerendered') else ''}rendered at "
        f"commit {prov['commit']} on "
        f"{prov['cpus']} CPUs ({prov['cpu']}), {prov['date']}.{_note(prov)}\n\n"
    )
    claims, per_question, claims_text = _claims(spec, results)
    body = render_table(spec, summary) + claims_text
    picks = best_per_group(spec, summary) if spec.select else []
    if picks:
        body += f"\n\nChosen per method (highest {spec.select}; these settings go into the comparison):\n\n"
        body += render_best(picks)
    fails = "".join(f"\n- failed: {k}: {v}" for k, v in sorted(failed.items()))
    write_atomic(out / f"{tag}.md", (head + body + "\n" + fails + f"\n\n![curves]({png.name})\n").encode())
    data = {
        "spec": spec.path,
        "quick": spec.quick,
        "provenance": prov,
        "rows": summary,
        "claims": claims,
        "question_claims": per_question,
        "chosen": picks,
        "runs": dict(sorted(results.items())),
        "failed": failed,
    }
    write_atomic(out / f"{tag}.json", json.dumps(_no_nan(data), indent=1, sort_keys=True).encode())
    print(head + body + fails)


def _claims(spec: Any, results: dict[str, Any]) -> tuple[list[Any], list[Any], str]:
    """The claims tested per seed and, with `per_question: true`, per held-out question; their text."""
    from experiments.grid import Spec
    from experiments.question_pairs import QUESTION_NOTE, question_claims, render_question_claims
    from experiments.report import check_claims, render_claims, render_findings

    claims, text = check_claims(spec, results), ""
    if claims:
        where = "experiments/report.py `check_claims`"
        text += f"\n\n{spec.claims_title}, checked per seed (verdicts: {where}):\n\n"
        paper = spec.claims_title == Spec.claims_title
        text += render_claims(claims, "the paper's ordering" if paper else "ordering")
        text += "\n\n" + render_findings(claims, spec.steps)
    per_question = question_claims(spec, results) if spec.per_question and claims else []
    if per_question:
        text += f"\n\nThe same orderings per held-out question ({QUESTION_NOTE}):\n\n"
        text += render_question_claims(per_question)
    return claims, per_question, text


def _note(prov: dict[str, Any]) -> str:
    """The dirty-tree note of --allow-dirty, or nothing."""
    return f" **{prov['note']}.**" if prov.get("note") else ""


def _no_nan(x: Any) -> Any:
    """JSON has no NaN: a missing figure (one seed's standard error, an absent hop) is null."""
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_no_nan(v) for v in x]
    return None if isinstance(x, float) and x != x else x
