"""The experiment grid behind `treeopsd experiment`: spec file → runs → table (pure; no torch, no files).

    spec = load_spec("configs/paper_table.yaml", quick=False)
    runs = plan(spec)                  # one Run per distinct (config, seed); rows with equal configs share
    table = render_table(spec, rows_summary(spec, results))

A spec (configs/paper_table.yaml) names a base config, seeds, steps, eval size, overrides common to every
run and rows of overrides. Two rows whose resolved configs are equal (e.g. "rho = 0.25" and the main
TreeOPSD row) point at the same runs, so nothing is trained twice. Every row is validated against
configs/schema.py before anything runs; a bad key or value is an ExperimentSpecError naming row and key.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from configs.schema import Config, ConfigError, load_config

SPEC_KEYS = {
    "name",
    "base",
    "seeds",
    "warmstart_seed",
    "steps",
    "eval_tasks",
    "budget",
    "common",
    "quick",
    "rows",
    "claims",
}
ROW_KEYS = {"name", "group", "train", "set"}


class ExperimentSpecError(ValueError):
    """A spec file that cannot run; the message names the file and the row or key."""


@dataclass(frozen=True)
class Row:
    name: str
    group: str
    train: bool
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Spec:
    path: str
    name: str
    base: str
    seeds: tuple[int, ...]
    steps: int
    eval_tasks: int
    budget: float | None
    common: tuple[str, ...]
    rows: tuple[Row, ...]
    quick: bool = False
    warmstart_seed: int | None = None  # one warm-started model for every seed (None: one per seed)
    claims: tuple[tuple[str, str], ...] = ()  # (better row, worse row): the paper's orderings to check

    def model_seed(self, seed: int) -> int:
        return seed if self.warmstart_seed is None else self.warmstart_seed


@dataclass(frozen=True)
class Run:
    """One training (or, for train: false rows, evaluation-only) run of one config and seed."""

    key: str  # "<t|e><config hash>-s<seed>[-w<warm-start seed>]": also the run's folder name
    seed: int
    train: bool
    overrides: tuple[str, ...]  # common + row, without per-run paths
    rows: tuple[str, ...] = field(default=())  # the rows this run stands for


def _overrides(mapping: Any, where: str) -> tuple[str, ...]:
    if mapping is None:
        return ()
    if not isinstance(mapping, Mapping):
        raise ExperimentSpecError(f"{where}: must be a mapping of config keys to values")
    return tuple(
        f"{k}={json.dumps(v)}" for k, v in mapping.items()
    )  # JSON is YAML: apply_overrides parses it


def load_spec(path: str | Path, quick: bool = False) -> Spec:
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ExperimentSpecError(f"experiment spec {p} does not exist") from None
    except yaml.YAMLError as e:
        raise ExperimentSpecError(f"experiment spec {p} is not valid YAML: {e}") from None
    return parse_spec(doc, str(p), quick)


def parse_spec(doc: Any, path: str = "<spec>", quick: bool = False) -> Spec:
    if not isinstance(doc, dict):
        raise ExperimentSpecError(f"{path}: must hold a mapping at the top level")
    if unknown := set(doc) - SPEC_KEYS:
        raise ExperimentSpecError(f"{path}: unknown keys {sorted(unknown)} (allowed: {sorted(SPEC_KEYS)})")
    if quick:
        q = doc.get("quick") or {}
        if not isinstance(q, dict) or set(q) - {"seeds", "steps", "eval_tasks"}:
            raise ExperimentSpecError(f"{path}: quick may set seeds, steps, eval_tasks only")
        doc = {**doc, **q}
    seeds = doc.get("seeds", [0])
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and s >= 0 for s in seeds)):
        raise ExperimentSpecError(f"{path}: seeds must be a non-empty list of integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ExperimentSpecError(f"{path}: seeds {seeds} repeat a seed")
    ints = {k: doc.get(k, d) for k, d in (("steps", 20), ("eval_tasks", 120))}
    for k, v in ints.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ExperimentSpecError(f"{path}: {k} must be an integer >= 1, got {v!r}")
    warm = doc.get("warmstart_seed")
    if warm is not None and (not isinstance(warm, int) or isinstance(warm, bool) or warm < 0):
        raise ExperimentSpecError(f"{path}: warmstart_seed must be an integer >= 0, got {warm!r}")
    budget = doc.get("budget")
    if budget is not None and (not isinstance(budget, int | float) or budget <= 0):
        raise ExperimentSpecError(f"{path}: budget must be a number > 0, got {budget!r}")
    rows_doc = doc.get("rows")
    if not isinstance(rows_doc, list) or not rows_doc:
        raise ExperimentSpecError(f"{path}: rows must be a non-empty list")
    rows = tuple(_row(r, i, path) for i, r in enumerate(rows_doc))
    names = [r.name for r in rows]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ExperimentSpecError(f"{path}: row names repeat: {dup}")
    base = str(doc.get("base") or Path(__file__).parent.parent / "configs" / "default.yaml")
    spec = Spec(
        path,
        str(doc.get("name") or Path(path).stem),
        base,
        tuple(seeds),
        ints["steps"],
        ints["eval_tasks"],
        budget,
        _overrides(doc.get("common"), f"{path}: common"),
        rows,
        quick,
        warm,
        _claims(doc.get("claims"), {r.name for r in rows}, path),
    )
    for row in rows:  # every row's config must load before anything runs
        cost = resolved_config(spec, row, seeds[0]).algo.expected_cost
        if budget is not None and row.group == "main" and row.train and not math.isclose(cost, budget):
            raise ExperimentSpecError(
                f"{path}: row {row.name!r} costs {cost:g} full trajectories per prompt, budget is {budget:g}"
            )
    return spec


def _claims(doc: Any, names: set[str], path: str) -> tuple[tuple[str, str], ...]:
    if doc is None:
        return ()
    if not isinstance(doc, list):
        raise ExperimentSpecError(f"{path}: claims must be a list of {{better: ROW, worse: ROW}}")
    out = []
    for i, c in enumerate(doc):
        if not isinstance(c, dict) or set(c) != {"better", "worse"}:
            raise ExperimentSpecError(f"{path}: claims[{i}] must be a mapping with keys better and worse")
        for side in ("better", "worse"):
            if c[side] not in names:
                raise ExperimentSpecError(f"{path}: claims[{i}].{side} = {c[side]!r} is not a row name")
        out.append((c["better"], c["worse"]))
    return tuple(out)


def _row(doc: Any, i: int, path: str) -> Row:
    where = f"{path}: rows[{i}]"
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str) or not doc["name"]:
        raise ExperimentSpecError(f"{where}: must be a mapping with a non-empty name")
    if unknown := set(doc) - ROW_KEYS:
        raise ExperimentSpecError(f"{where} ({doc['name']}): unknown keys {sorted(unknown)}")
    train = doc.get("train", True)
    if not isinstance(train, bool):
        raise ExperimentSpecError(f"{where} ({doc['name']}): train must be true or false")
    over = _overrides(doc.get("set"), f"{where} ({doc['name']}) set")
    return Row(doc["name"], str(doc.get("group", "main")), train, over)


def resolved_config(spec: Spec, row: Row, seed: int, extra: Sequence[str] = ()) -> Config:
    try:
        return load_config(spec.base, [*spec.common, *row.overrides, f"run.seed={seed}", *extra])
    except ConfigError as e:
        raise ExperimentSpecError(f"{spec.path}: row {row.name!r}: {e}") from None


def config_key(cfg: Config) -> str:
    """Hash of what decides a run's outcome (paths, names and logging excluded)."""
    from configs.schema import to_dict

    d = to_dict(cfg)
    d["run"] = {k: v for k, v in d["run"].items() if k not in ("name", "run_dir")}
    for k in ("store", "logging", "weights", "resources"):
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:10]


def plan(spec: Spec) -> list[Run]:
    """Distinct runs in seed-major order (all rows of the first seed first: a cut-short grid stays usable)."""
    runs: dict[str, Run] = {}
    for seed in spec.seeds:
        for row in spec.rows:
            cfg = resolved_config(spec, row, seed, (f"run.steps={spec.steps}",))
            warm = "" if spec.warmstart_seed is None else f"-w{spec.warmstart_seed}"
            key = f"{'t' if row.train else 'e'}{config_key(cfg)}-s{seed}{warm}"
            if key in runs:
                runs[key] = Run(key, seed, row.train, runs[key].overrides, (*runs[key].rows, row.name))
            else:
                runs[key] = Run(key, seed, row.train, (*spec.common, *row.overrides), (row.name,))
    return list(runs.values())


# ---- statistics and the table --------------------------------------------------------------------------
def mean_se(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n)); se is nan for a single value."""
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    m = sum(xs) / n
    if n == 1:
        return m, math.nan
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def rows_summary(spec: Spec, results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per row: success (overall, 3-hop, 4-hop) mean ± se over the seeds whose runs finished."""
    out = []
    for row in spec.rows:
        got = [r for r in results.values() if row.name in r["rows"] and "eval" in r]
        summary: dict[str, Any] = {
            "row": row.name,
            "group": row.group,
            "seeds": sorted(r["seed"] for r in got),
        }
        summary["cost"] = got[0]["expected_cost"] if got and row.train else 0.0
        for label, pick in (
            ("success", lambda e: e["success"]),
            ("hop3", lambda e: e.get("per_hop", {}).get("3", {}).get("success", math.nan)),
            ("hop4", lambda e: e.get("per_hop", {}).get("4", {}).get("success", math.nan)),
        ):
            summary[label] = mean_se([pick(r["eval"]) for r in got])
        summary["train_s"] = sum(r.get("train_s", 0.0) for r in got) / max(1, len(got))
        out.append(summary)
    return out


def _fmt(ms: tuple[float, float], signed: bool = False) -> str:
    m, se = ms
    if math.isnan(m):
        return "—"
    head = f"{m:+.3f}" if signed else f"{m:.3f}"
    return head if math.isnan(se) else f"{head} ± {se:.3f}"


def render_table(spec: Spec, summary: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one line per row, grouped; success mean ± standard error over seeds."""
    lines = [
        "| group | method | cost | seeds | success (3–4 hop) | 3-hop | 4-hop |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        cost = f"{s['cost']:g}" if s["cost"] else "—"
        cells = [
            s["group"],
            s["row"],
            cost,
            str(len(s["seeds"])),
            _fmt(s["success"]),
            _fmt(s["hop3"]),
            _fmt(s["hop4"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_claims(spec: Spec, results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each claim "better > worse" on held-out success, from per-seed paired differences (the rows of one
    seed share prompts, sampling seed and start model): mean ± se of the differences and a verdict —
    "reproduced" (mean > 2 se above 0), "reversed" (mean > 2 se below 0), "tie" (all differences 0),
    "within noise" otherwise (with the direction of the mean, if any)."""
    by_row: dict[str, dict[int, float]] = {}
    for r in results.values():
        if "eval" not in r:
            continue
        for name in r["rows"]:
            by_row.setdefault(name, {})[r["seed"]] = float(r["eval"]["success"])
    out = []
    for better, worse in spec.claims:
        a, b = by_row.get(better, {}), by_row.get(worse, {})
        diffs = [a[s] - b[s] for s in sorted(set(a) & set(b))]
        m, se = mean_se(diffs)
        if not diffs:
            verdict = "no data"
        elif all(abs(d) < 1e-12 for d in diffs):
            verdict = "tie"
        elif not math.isnan(se) and m > 2 * se:
            verdict = "reproduced"
        elif not math.isnan(se) and m < -2 * se:
            verdict = "reversed"
        elif abs(m) < 1e-9:  # differences that cancel: no direction to report
            verdict = "within noise (no mean difference)"
        else:
            verdict = f"within noise ({'same' if m > 0 else 'opposite'} direction)"
        out.append(
            {"better": better, "worse": worse, "seeds": len(diffs), "diff": (m, se), "verdict": verdict}
        )
    return out


def render_claims(claims: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| the paper's ordering | seeds | success difference (paired) | here |",
        "|---|---:|---:|---|",
    ]
    for c in claims:
        diff = _fmt(c["diff"], signed=True)
        lines.append(f"| {c['better']} > {c['worse']} | {c['seeds']} | {diff} | {c['verdict']} |")
    return "\n".join(lines)
