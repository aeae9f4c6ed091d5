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
    "claims_title",
    "samples",
    "ablation_seeds",
    "select",
    "drift",  # read by experiments/offpolicy_drift.py, not by the grid
    "prepare",  # data and a protocol warm start made before the first run (experiments/prepare.py)
    "per_question",  # also test each claim over paired questions (experiments/question_pairs.py)
}
ROW_KEYS = {"name", "group", "train", "set"}
QUICK_KEYS = {"seeds", "ablation_seeds", "steps", "eval_tasks", "samples"}
PREPARE_KEYS = {"data", "warmstart"}
WARMSTART_KEYS = {"model", "steps", "hops", "out"}
DATA_MAKERS = ("fanout-wiki",)  # `treeopsd data fanout-wiki` (actors/envs/fanout_wiki.py)


class ExperimentSpecError(ValueError):
    """A spec file that cannot run; the message names the file and the row or key."""


@dataclass(frozen=True)
class Row:
    name: str
    group: str
    train: bool
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Prepare:
    """What the grid makes once before its runs, as `make real-demo` does: the data files of env.data,
    env.eval_data and env.corpus (`data`), and an SFT of `model` on env.protocol's oracle trajectories
    (`treeopsd warmstart --steps S --hops A B --out MODELS_DIR/OUT model.path=MODEL`), cached."""

    data: str | None
    model: str
    steps: int
    hops: tuple[int, int]
    out: str


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
    samples: int = 0  # sampled episodes per evaluation question (temperature 1), besides the greedy one
    ablation_seeds: tuple[int, ...] | None = None  # seeds of the rows outside group "main" (None: all)
    select: str | None = None  # a tuning grid: report each group's best row by this metric
    claims_title: str = "The paper's orderings"  # what the claims are, in the table's words
    prepare: Prepare | None = None  # data and a protocol warm start before the runs (None: the tiny model)
    per_question: bool = False  # claims also tested over paired questions (experiments/question_pairs.py)

    def model_seed(self, seed: int) -> int:
        return seed if self.warmstart_seed is None else self.warmstart_seed

    def row_seeds(self, row: Row) -> tuple[int, ...]:
        """The main rows run every seed; the ablations the first few (`ablation_seeds`)."""
        return self.seeds if row.group == "main" or self.ablation_seeds is None else self.ablation_seeds


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
        if not isinstance(q, dict) or set(q) - QUICK_KEYS:
            raise ExperimentSpecError(f"{path}: quick may set {', '.join(sorted(QUICK_KEYS))} only")
        doc = {**doc, **q}
    seeds = doc.get("seeds", [0])
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and s >= 0 for s in seeds)):
        raise ExperimentSpecError(f"{path}: seeds must be a non-empty list of integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ExperimentSpecError(f"{path}: seeds {seeds} repeat a seed")
    ints = {k: doc.get(k, d) for k, d in (("steps", 20), ("eval_tasks", 120), ("samples", 0))}
    for k, v in ints.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "samples" else 1):
            raise ExperimentSpecError(f"{path}: {k} must be an integer >= {int(k != 'samples')}, got {v!r}")
    ablation = _ablation_seeds(doc.get("ablation_seeds"), seeds, path)
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
        ints["samples"],
        ablation,
        _select(doc.get("select"), path),
        str(doc.get("claims_title") or Spec.claims_title),
        _prepare(doc.get("prepare"), path),
        _flag(doc.get("per_question", False), "per_question", path),
    )
    _check_rows(spec)
    return spec


def _check_rows(spec: Spec) -> None:
    """Every row's config loads and a main row costs the budget, before anything runs."""
    for row in spec.rows:
        cost = resolved_config(spec, row, spec.seeds[0]).algo.expected_cost
        budget = spec.budget
        if budget is not None and row.group == "main" and row.train and not math.isclose(cost, budget):
            raise ExperimentSpecError(
                f"{spec.path}: row {row.name!r} costs {cost:g} full trajectories per prompt, budget is "
                f"{budget:g}"
            )
    if spec.prepare is not None and spec.prepare.data is not None:
        data_dir(spec)  # the layout the data maker writes, or one line naming the key


DATA_FILES = {"data": "train.jsonl", "eval_data": "heldout.jsonl", "corpus": "corpus.jsonl"}


def data_dir(spec: Spec) -> Path:
    """The folder `prepare.data` writes: every row's env.data, env.eval_data and env.corpus must be its
    train.jsonl, heldout.jsonl and corpus.jsonl (what `treeopsd data fanout-wiki OUT` writes)."""
    folders = set()
    for row in spec.rows:
        env = resolved_config(spec, row, spec.seeds[0]).env
        for key, name in DATA_FILES.items():
            value = getattr(env, key)
            if value is None or Path(value).name != name:
                raise ExperimentSpecError(
                    f"{spec.path}: row {row.name!r}: env.{key} = {value!r} is invalid: expected "
                    f"<folder>/{name} (prepare.data = {spec.prepare and spec.prepare.data} writes that)"
                )
            folders.add(Path(value).parent)
    if len(folders) != 1:
        raise ExperimentSpecError(
            f"{spec.path}: env.data, env.eval_data and env.corpus must share one folder"
        )
    return folders.pop()


def _flag(doc: Any, key: str, path: str) -> bool:
    if not isinstance(doc, bool):
        raise ExperimentSpecError(f"{path}: {key} must be true or false, got {doc!r}")
    return doc


def _prepare(doc: Any, path: str) -> Prepare | None:
    """The `prepare` section: {data: fanout-wiki, warmstart: {model, steps, hops: [A, B], out}}."""
    if doc is None:
        return None
    where = f"{path}: prepare"
    if not isinstance(doc, dict) or set(doc) - PREPARE_KEYS or "warmstart" not in doc:
        raise ExperimentSpecError(f"{where} must be a mapping with warmstart (and optionally data)")
    data = doc.get("data")
    if data is not None and data not in DATA_MAKERS:
        raise ExperimentSpecError(f"{where}.data must be one of {list(DATA_MAKERS)}, got {data!r}")
    warm = doc["warmstart"]
    if not isinstance(warm, dict) or set(warm) != WARMSTART_KEYS:
        raise ExperimentSpecError(f"{where}.warmstart must be a mapping with keys {sorted(WARMSTART_KEYS)}")
    steps, hops = warm["steps"], warm["hops"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ExperimentSpecError(f"{where}.warmstart.steps must be an integer >= 1, got {steps!r}")
    ok = isinstance(hops, list) and len(hops) == 2 and all(isinstance(h, int) and h >= 1 for h in hops)
    if not ok or hops[0] > hops[1]:
        raise ExperimentSpecError(
            f"{where}.warmstart.hops must be [MIN, MAX] with 1 <= MIN <= MAX, got {hops!r}"
        )
    for key in ("model", "out"):
        if not isinstance(warm[key], str) or not warm[key]:
            raise ExperimentSpecError(f"{where}.warmstart.{key} must be a non-empty string")
    if "/" in warm["out"]:
        raise ExperimentSpecError(f"{where}.warmstart.out must be a folder name (it goes into --models-dir)")
    return Prepare(data, warm["model"], steps, (hops[0], hops[1]), warm["out"])


def _select(doc: Any, path: str) -> str | None:
    if doc is not None and doc not in ("success", "sampled_success"):
        raise ExperimentSpecError(f"{path}: select must be success or sampled_success, got {doc!r}")
    return doc


def _ablation_seeds(doc: Any, seeds: list[int], path: str) -> tuple[int, ...] | None:
    if doc is None:
        return None
    if not (isinstance(doc, list) and doc and set(doc) <= set(seeds) and len(set(doc)) == len(doc)):
        raise ExperimentSpecError(
            f"{path}: ablation_seeds must be a non-empty subset of seeds {seeds}, got {doc!r}"
        )
    return tuple(doc)


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
    bound = d.get("store", {}).get("max_turn_kl")  # drift-bounded staleness changes what is trained
    for k in ("store", "logging", "weights", "resources"):
        d.pop(k, None)
    if bound is not None:
        d["max_turn_kl"] = bound
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:10]


def warm_key(spec: Spec, row: Row, seed: int) -> str:
    """What decides the model a row starts from (its `model` section and whether it thinks): rows with
    one key share a warm start; a horizon sweep's rows (model.warmstart_hops) each have their own."""
    cfg = resolved_config(spec, row, spec.model_seed(seed))
    start = {"model": cfg.model.model_dump(mode="json"), "think": cfg.env.think_tokens > 0}
    return json.dumps(start, sort_keys=True)


def plan(spec: Spec) -> list[Run]:
    """Distinct runs in seed-major order (all rows of the first seed first: a cut-short grid stays usable)."""
    runs: dict[str, Run] = {}
    for seed in spec.seeds:
        for row in (r for r in spec.rows if seed in spec.row_seeds(r)):
            cfg = resolved_config(spec, row, seed, (f"run.steps={spec.steps}",))
            warm = "" if spec.warmstart_seed is None else f"-w{spec.warmstart_seed}"
            key = f"{'t' if row.train else 'e'}{config_key(cfg)}-s{seed}{warm}"
            if key in runs:
                runs[key] = Run(key, seed, row.train, runs[key].overrides, (*runs[key].rows, row.name))
            else:
                runs[key] = Run(key, seed, row.train, (*spec.common, *row.overrides), (row.name,))
    return list(runs.values())
