"""The fault-tolerance figures of docs/results.md, rendered from the reports the soak and the drill write.

    python -m tools.fault_report benchmarks/results     # soak.json, drill.json there → faults.md

`treeopsd soak --results DIR` and `treeopsd drill --results DIR` copy their report to DIR/soak.json or
DIR/drill.json; `make readme` renders DIR/faults.md from them with this module (repository tooling, not
installed with the package), and docs/results.md shows it.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from storage.durable import write_atomic


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def soak_lines(r: dict[str, Any]) -> list[str]:
    store, kills = r["store"], r["kills"]
    times = [float(t) for t, _, _ in r["kill_log"]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    every = f", one every {statistics.median(gaps):.0f} s (median)" if gaps else ""
    lines = [
        f"**Soak** (`treeopsd soak --minutes {r['minutes']:g}"
        + (f" --every {r['every']:g} --seed {r['seed']}" if "every" in r else "")
        + f"`): {r['steps']} learner steps in {r['minutes']:g} minutes under {sum(kills.values())} SIGKILLs"
        + f"{every} — "
        + ", ".join(f"{role} {n}" for role, n in sorted(kills.items()))
        + ".",
        "",
        "| check | result |",
        "|---|---|",
        f"| trees committed | {store['trees_committed']} |",
        f"| trees lost / duplicated / half-visible | {store['trees_lost']} / {store['trees_duplicated']} / "
        f"{store['trees_half_visible']} |",
        f"| batches trained twice / skipped | {len(r['batches_trained_twice'])} / "
        f"{len(r['batches_skipped'])} |",
        f"| batches handed out, not trained | {r['batches_handed_out_not_trained']} |",
        f"| commits killed before their rename (never visible) | {store['interrupted_commits']} |",
        "| restarts | " + ", ".join(f"{k} {v}" for k, v in sorted(r["restarts"].items())) + " |",
        f"| every invariant held | {_yes(r['ok'])} |",
        "",
        f"Resident memory per role: the least-squares slope of each process after its first "
        f"{r['memory_warmup_s']:g} s, over processes watched at least {r.get('memory_window_s', 0):g} s past "
        "that (a restarted role is a new process; a shorter life measures its allocation transients, not a "
        "leak); the largest such slope per role:",
        "",
        "| role | processes | measured | longest lived (s) | RSS at end (MB) | slope (MB/min) "
        "| below 2 MB/min |",
        "|---|---|---|---|---|---|---|",
    ]
    for role, m in sorted(r["memory"].items()):
        slope = m["max_slope_mb_per_min"]
        below = "—" if slope is None else _yes(slope < 2.0)
        lines.append(
            f"| {role} | {m['processes']} | {m.get('measured', '—')} | {m['longest_lived_s']:.0f} | "
            f"{m['rss_mb']:.0f} | {'—' if slope is None else f'{slope:.3f}'} | {below} |"
        )
    return lines


def drill_lines(r: dict[str, Any]) -> list[str]:
    kills = ", ".join(f"{role} at step {step}" for step, role, _ in r["kills"])
    lines = [
        f"**Drill** (`treeopsd drill --steps {r['steps']}`: `treeopsd train --steps {r['steps']}` as a "
        f"child, each role SIGKILLed once): {kills}; {r['wall_s']:.0f} s in all.",
        "",
        "| check | result |",
        "|---|---|",
    ]
    lines += [f"| {name.replace('_', ' ')} | {_yes(ok)} |" for name, ok in r["checks"].items()]
    restarts = ", ".join(f"{k} {v}" for k, v in sorted(r["restarts"].items()))
    lines += [
        f"| steps in the learner's lineage / batches in the store | {r['steps_trained']} / "
        f"{r['store_batches']} |",
        f"| restarts | {restarts} |",
        f"| `store verify` | {' '.join(r['store_verify'])} |",
    ]
    return lines


def render(folder: Path) -> str:
    parts = ["# Fault tolerance, measured", ""]
    for name, lines in (("soak.json", soak_lines), ("drill.json", drill_lines)):
        path = folder / name
        if path.exists():
            parts += [*lines(json.loads(path.read_text())), ""]
    return "\n".join(parts).rstrip() + "\n"


def publish(report: dict[str, Any], name: str, folder: str | Path) -> Path:
    """Copies `report` to folder/name and re-renders folder/faults.md; the markdown's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / name, json.dumps(report, indent=2).encode())
    write_atomic(folder / "faults.md", render(folder).encode())
    return folder / "faults.md"


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    write_atomic(target / "faults.md", render(target).encode())
