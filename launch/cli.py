"""The `treeopsd` console script.

Subcommands live in their own modules and are imported lazily, so `treeopsd store inspect` never pays for
torch/Ray imports. Each module `launch/cmd_<name>.py` exposes `add_arguments(parser)` and `run(args) -> int`.
Benchmarks: `treeopsd bench NAME --json` runs `benchmarks/bench_<name>.py:run(args) -> dict` and prints one
JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from runtime.lean_imports import hide_unused_optional_packages

COMMANDS = {
    "train": "asynchronous (or --sync) training on Ray",
    "demo": "one-command demo on the embedded default (tiny model, offline task)",
    "eval": "evaluate a model on a task (success / EM / F1 per dataset)",
    "warmstart": "build the tiny model and SFT it on oracle trajectories of the default task",
    "rollout": "sample rollout trees into a replay store",
    "store": "inspect or verify a replay store",
    "report": "render PNG plots from a run's tensorboard logs",
    "scale": "add or remove sampler actors of a running job",
    "export": "write a learner checkpoint (either format) as a Hugging Face folder",
    "experiment": "run the paper-table experiment grid",
    "retrieve": "serve a corpus over HTTP for all samplers (Search-R1's POST /retrieve)",
    "model": "import a .gguf model file as a Hugging Face folder",
    "data": "dataset tools (decrypt BrowseComp-Plus queries)",
    "config": "print the resolved config (`config show [--config F] [k=v ...]`)",
    "soak": "train while killing a random role on a schedule; audit the store and the batches after",
    "drill": "`train --steps N` with each role SIGKILLed once at random; check every batch trained once",
    "view": "a local web page over a run's rollout trees (`view RUN_DIR`, or `--export DIR`)",
}
BENCHMARKS = ("store", "sampler", "learner", "pipeline", "weights", "credit", "retrieval", "learner_ranks")
BENCHMARKS += ("view",)
# a benchmark is the module benchmarks.bench_<name> unless named here
BENCH_MODULES = {"learner_ranks": "benchmarks.learner_ranks"}
BENCH_ALIASES = {"learner_scale": "learner_ranks"}  # the name the issue tracker and earlier notes use


def positive_int(text: str) -> int:
    """argparse type of a count flag: an integer >= 1 (argparse makes the error one usage line, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print one JSON object")
    p.add_argument("name", choices=(*BENCHMARKS, *BENCH_ALIASES, "all"))
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (default)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    p.add_argument("--out", default=None, help="also write the JSON here (with `all`: and a .md summary)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="learner, with --shape: benchmarks/learner_gpu.py",
    )
    p.add_argument(
        "--shape", default=None, help="learner: qwen3-0.6b, qwen3-1.7b, qwen3-4b or tiny (comma list)"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="learner --shape: steps per layout (first: compiles)"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="learner --shape: a config override"
    )
    p.add_argument(
        "--profile", action="store_true", help="learner --shape: one more step under torch.profiler"
    )


def _run_bench(args: argparse.Namespace) -> int:
    names = BENCHMARKS if args.name == "all" else (BENCH_ALIASES.get(args.name, args.name),)
    results = {}
    for name in names:
        module = importlib.import_module(BENCH_MODULES.get(name, f"benchmarks.bench_{name}"))
        try:
            results[name] = module.run(args)
        except ValueError as e:  # a bad flag (an unknown --shape, --device cuda without CUDA): one line
            print(f"treeopsd bench {name}: {e}", file=sys.stderr)
            return 2
    out = results[names[0]] if len(names) == 1 else results
    text = json.dumps(out, sort_keys=True)
    print(text)
    if args.out:
        from storage.durable import write_atomic

        write_atomic(args.out, (text + "\n").encode())
        if len(names) > 1:
            _write_summary(results, args.out)
        elif callable(render := getattr(module, "render", None)):  # its own markdown beside the JSON
            from pathlib import Path

            write_atomic(Path(args.out).with_suffix(".md"), render(out).encode())
    return 0


def _write_summary(results: dict, out: str) -> None:
    """`bench all --out X.json` also writes X.md: every headline figure beside its goal and baseline."""
    import os
    import platform
    from pathlib import Path

    from benchmarks.summary import render
    from experiments import provenance
    from storage.durable import write_atomic

    where = (
        f"Commit {provenance.commit()}, {os.cpu_count()} CPUs ({provenance.cpu_model()}), Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.2f} at the end, {provenance.now()}."
    )
    write_atomic(Path(out).with_suffix(".md"), render(results, where).encode())
    if isinstance(results.get("credit"), dict) and "trees" in results["credit"]:
        from benchmarks.credit_report import render as render_credit

        write_atomic(Path(out).with_name("credit.md"), render_credit(results["credit"]).encode())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treeopsd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        mod = importlib.import_module(f"launch.cmd_{name}")
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers' own progress bars (loading and writing weights, a few ms each) follow the hub's
    # switch; the project's bars (steps, evaluation) stay. HF_HUB_DISABLE_PROGRESS_BARS=0 keeps them too.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hide_unused_optional_packages()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may stand anywhere (`treeopsd eval a.b=1 --samples 4 c.d=2`): argparse only takes one run
    # of positionals, so later `key=value` items come back here and join the others.
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "bench":
        return _run_bench(args)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
