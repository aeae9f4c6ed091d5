"""The import rules docs/architecture.md states ("Layers and import rules"; docs/design.md §8), checked by
walking every module's imports. That page lists exactly these five rules, in this order."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "configs",
    "system",
    "storage",
    "actors",
    "learner",
    "runtime",
    "experiments",
    "faults",
    "launch",
    "benchmarks",
    "viewer",
)
ROLES = {"configs", "system", "storage", "actors", "learner"}
# Rule 1: who may import whom (launch, the commands, and benchmarks: anything).
ALLOWED = {
    "configs": {"configs"},
    "system": {"configs", "system"},
    "storage": {"configs", "system", "storage"},
    "actors": {"configs", "system", "storage", "actors"},
    "learner": {"configs", "system", "storage", "learner"},
    "runtime": {*ROLES, "runtime"},  # places, starts, supervises and stops the roles
    "experiments": {*ROLES, "runtime", "experiments"},
    "faults": {*ROLES, "runtime", "faults"},
    "viewer": {"configs", "system", "storage", "viewer"},  # reads a run's files; launch/cmd_view.py wires it
}
ZMQ_FILES = {"learner/weight_publisher.py", "actors/weight_subscriber.py"}  # rule 3
PURE = ("system", "learner/losses.py")  # rule 5
IO_FRAMEWORKS = {"ray", "zmq", "pyarrow", "socket", "tensorboard"}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield pkg, path


def tops(path: Path) -> set[str]:
    return {n.split(".")[0] for n in imports_of(path)}


def test_rule_1_layering():
    bad = []
    for pkg, path in modules():
        for name in imports_of(path) if pkg in ALLOWED else ():
            top = name.split(".")[0]
            if top in PACKAGES and top not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_rule_2_ray_only_in_actor_shells_launch_and_benchmarks():
    bad = [
        str(path.relative_to(ROOT))
        for pkg, path in modules()
        if "ray" in tops(path)
        and not (path.name.endswith("_actor.py") or pkg in ("runtime", "faults", "launch", "benchmarks"))
    ]
    assert not bad, bad


def test_rule_3_zmq_only_in_the_weight_transport_and_benchmarks():
    bad = [
        rel
        for pkg, path in modules()
        if "zmq" in tops(path)
        and (rel := str(path.relative_to(ROOT))) not in ZMQ_FILES
        and pkg != "benchmarks"
    ]
    assert not bad, bad


def test_rule_4_pickle_only_in_benchmarks():
    bad = [str(p.relative_to(ROOT)) for pkg, p in modules() if "pickle" in tops(p) and pkg != "benchmarks"]
    assert not bad, bad


def test_rule_5_pure_core_has_no_io_frameworks():
    paths = [
        p
        for entry in PURE
        for p in ((ROOT / entry).rglob("*.py") if (ROOT / entry).is_dir() else [ROOT / entry])
    ]
    assert len(paths) > 5  # the rule covers real files
    bad = {
        str(p.relative_to(ROOT)): sorted(tops(p) & IO_FRAMEWORKS) for p in paths if tops(p) & IO_FRAMEWORKS
    }
    assert not bad, bad


def module_edges() -> dict[str, set[str]]:
    """Every module of the packages (and tools/) → the modules of ours it imports, at the top or inside a
    function (a lazy import still ties the two files together)."""
    paths = {}
    for pkg in (*PACKAGES, "tools"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            paths[path] = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    ours = set(paths.values())
    edges: dict[str, set[str]] = {}
    for path, mod in paths.items():
        found = {name for name in imports_of(path) if name in ours}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update(f"{node.module}.{a.name}" for a in node.names)
        edges[mod] = (found & ours) - {mod}
    return edges


def test_no_two_modules_import_each_other():
    edges = module_edges()
    pairs = sorted({tuple(sorted((a, b))) for a, out in edges.items() for b in out if a in edges.get(b, ())})
    assert not pairs, pairs


def test_launch_reaches_benchmarks_only_through_the_bench_command():
    edges = module_edges()
    bad = [
        (a, b)
        for a, out in edges.items()
        for b in out
        if a.startswith(("launch.", "runtime.", "experiments.", "faults.")) and b.startswith("benchmarks")
    ]
    assert all(a == "launch.cli" for a, _ in bad), bad  # `treeopsd bench` runs and renders the benchmarks
