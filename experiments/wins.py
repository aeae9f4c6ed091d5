"""Where TreeOPSD wins, ties and loses across the method tables: one paragraph, generated from their results
files (README "Where TreeOPSD wins, in one paragraph"; `make readme` writes it).

    python -m experiments.wins benchmarks/results/horizon_sweep.json \
        benchmarks/results/horizon_ablations.json benchmarks/results/real_table.json \
        --out benchmarks/results/where_treeopsd_wins.md

Each table's claims were stated in its config before its runs and are tested there on greedy held-out
success, paired per seed, t with n − 1 degrees of freedom (experiments/report.py `check_claims`). Here the
claims that put TreeOPSD against another method or variant are sorted by that verdict: a win (holds), a
loss (reversed), or no difference shown (a tie, or not significant); where a table also tests a claim per
held-out question (the real table), that test and its verdict follow the per-seed figures. The claims
against the untrained warm start say whether a method learned at all, so they get a sentence of their
own. A results file that does not exist yet is named as not run; nothing is inferred for it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.stats import PairedTest
from storage.durable import write_atomic

UNTRAINED = "untrained"


def classify(claims: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[str, PairedTest]]]:
    """TreeOPSD's claims by what their greedy test says: "wins", "ties" (no difference shown), "losses";
    "learned" / "not learned" for those against the untrained warm start."""
    out: dict[str, list[tuple[str, PairedTest]]] = {
        k: [] for k in ("wins", "ties", "losses", "learned", "not learned")
    }
    for c in claims:
        if "TreeOPSD" not in c["better"]:
            continue
        test = PairedTest(**c["test"])
        if UNTRAINED in c["worse"]:
            out["learned" if test.verdict == "holds" else "not learned"].append((c["better"], test))
            continue
        kind = {"holds": "wins", "reversed": "losses"}.get(test.verdict, "ties")
        out[kind].append((f"{c['better']} over {c['worse']}", test))
    return out


def per_question(results: Mapping[str, Any]) -> dict[str, PairedTest]:
    """A table's per-question greedy tests (experiments/question_pairs.py), by "better over worse"."""
    return {
        f"{q['better']} over {q['worse']}": PairedTest(**q["success"]["test"])
        for q in results.get("question_claims", [])
    }


def _items(
    pairs: Sequence[tuple[str, PairedTest]], table: str, questions: Mapping[str, PairedTest]
) -> list[str]:
    """Each claim with its per-seed figures, then its per-question test where the table has one."""
    out = []
    for what, test in pairs:
        extra = f"; per question: {questions[what].line()}" if what in questions else ""
        out.append(f"{what} ({table}: {test.line().rsplit(':', 1)[0]}{extra})")
    return out


def paragraph(tables: Mapping[str, Mapping[str, Any] | None]) -> str:
    """The paragraph over `tables` (its name -> its results file's content, None when not run)."""
    said: dict[str, list[str]] = {k: [] for k in ("wins", "ties", "losses", "learned", "not learned")}
    seen: set[PairedTest] = set()
    for name, results in tables.items():
        if results is None:
            continue
        questions = per_question(results)
        for kind, pairs in classify(results["claims"]).items():
            if kind in ("learned", "not learned"):  # tables sharing runs state the same claim: once
                pairs = [(what, t) for what, t in pairs if t not in seen]
                seen.update(t for _, t in pairs)
            said[kind] += _items(pairs, name, questions)
    missing = [name for name, results in tables.items() if results is None]
    sentences = [
        "At this scale (tiny models on the synthetic task, SmolLM2-135M with LoRA on real text; greedy "
        "held-out success, paired per seed, t with n − 1 degrees of freedom, two-sided 5 %), of the "
        "orderings each table stated before its runs (the first named claimed better; sorted by the per-seed "
        "test, a per-question test after it where the table has one), these hold, where "
        f"TreeOPSD wins: {'; '.join(said['wins']) or 'none'}.",
        f"No difference is shown: {'; '.join(said['ties']) or 'none'}.",
        f"Reversed, where it loses: {'; '.join(said['losses']) or 'none'}.",
        f"TreeOPSD beats its untrained warm start: {'; '.join(said['learned']) or 'nowhere'}; it is not "
        f"shown to: {'; '.join(said['not learned']) or 'nowhere'}.",
    ]
    if missing:
        sentences.append(f"Not run yet, so not counted: {', '.join(missing)}.")
    return " ".join(sentences)


def load(path: Path) -> dict[str, Any] | None:
    """A results file's content (None when it does not exist); ValueError naming the file when it is not
    one of `treeopsd experiment`'s."""
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a results file of `treeopsd experiment` (not JSON: {e})") from e
    if (
        not isinstance(results, dict)
        or "claims" not in results
        or "commit" not in results.get("provenance", {})
    ):
        raise ValueError(f"{path}: not a results file of `treeopsd experiment` (no claims or no commit)")
    return results


def render(paths: Sequence[Path]) -> str:
    tables: dict[str, Mapping[str, Any] | None] = {}
    stamps = []
    for path in paths:
        results = tables[path.stem.replace("_", " ")] = load(path)
        if results is not None:
            stamps.append(f"{path.name} at commit {results['provenance']['commit']}")
    head = f"Generated by `python -m experiments.wins` from {', '.join(stamps) or 'no results file'}."
    return f"# Where TreeOPSD wins\n\n{head}\n\n{paragraph(tables)}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.wins", description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results files of `treeopsd experiment`")
    parser.add_argument("--out", type=Path, required=True, help="the markdown paragraph")
    args = parser.parse_args(argv)
    try:
        text = render(args.results)
    except ValueError as e:
        print(f"python -m experiments.wins: {e}", file=sys.stderr)
        return 2
    write_atomic(args.out, text.encode())
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
