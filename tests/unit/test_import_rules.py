"""architecture.md's import rules, checked by walking every module's imports."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("configs", "system", "storage", "actors", "learner", "launch", "benchmarks")
ALLOWED = {
    "configs": set(),
    "system": {"configs", "system"},
    "storage": {"configs", "system", "storage"},
    "actors": {"configs", "system", "storage", "actors"},
    "learner": {"configs", "system", "storage", "learner"},
}


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


def test_layering():
    bad = []
    for pkg, path in modules():
        if pkg not in ALLOWED:
            continue
        for name in imports_of(path):
            top = name.split(".")[0]
            if top in PACKAGES and top not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_ray_only_in_actor_shells_and_launch_and_zmq_only_in_weight_transport():
    bad = []
    for pkg, path in modules():
        tops = {n.split(".")[0] for n in imports_of(path)}
        if "ray" in tops and not (path.name.endswith("_actor.py") or pkg in ("launch", "benchmarks")):
            bad.append(f"{path.relative_to(ROOT)} imports ray")
        if "zmq" in tops and "weight" not in path.name and pkg != "benchmarks":
            bad.append(f"{path.relative_to(ROOT)} imports zmq")
        if "pickle" in tops and pkg != "benchmarks":
            bad.append(f"{path.relative_to(ROOT)} imports pickle")
    assert not bad, bad


def test_pure_core_has_no_io_frameworks():
    for path in [*(ROOT / "system").rglob("*.py"), ROOT / "learner" / "losses.py"]:
        if not path.exists():
            continue
        tops = {n.split(".")[0] for n in imports_of(path)}
        assert not tops & {"ray", "zmq", "pyarrow", "socket", "tensorboard"}, path
