"""The fault tolerance's state is its own (runtime/fault_tolerance.py): no module of the tree other than its
own touches the fields `FaultTolerance.__init__` makes private (budgets, counts, batch events, last errors),
nor counts a restart into a `Budgets`; the driver reaches it through `failed`, `check_*`, `trained`,
`metrics`, `summary`. A mutation that writes that state from elsewhere is reported."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_role_protocols import tree_sources

ROOT = Path(__file__).resolve().parents[2]
OWNER = "runtime/fault_tolerance.py"


def state_fields() -> set[str]:
    """The private fields `FaultTolerance.__init__` assigns (`self._x = ...`): the state it owns."""
    tree = ast.parse((ROOT / OWNER).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FaultTolerance")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    targets = [t for n in ast.walk(init) if isinstance(n, ast.Assign | ast.AnnAssign) for t in _targets(n)]
    return {t.attr for t in targets if isinstance(t, ast.Attribute) and t.attr.startswith("_")}


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return list(node.targets) if isinstance(node, ast.Assign) else [node.target]


def touches(module: str, source: str, fields: set[str]) -> list[str]:
    """Where `source` reads or writes one of `fields`, or counts into a Budgets (`.record(role, ...)` on
    anything named like budgets), as `module:line field`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in fields:
            out.append(f"{module}:{node.lineno} {node.attr}")
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Attribute) and f.attr == "record" and "budget" in ast.unparse(f.value).lower():
            out.append(f"{module}:{node.lineno} budgets.record")
    return out


def test_the_state_is_what_the_issue_lists():
    fields = state_fields()
    assert {"_budgets", "_restarts", "_step_retries", "_events", "_last_store_error"} <= fields
    assert {"_sampler_failures", "_last_sampler_error", "_store_pid", "_last_healthy"} <= fields


def test_no_other_module_touches_the_fault_tolerance_s_state():
    fields = state_fields()
    found = [
        t
        for module, source in tree_sources().items()
        if module != OWNER
        for t in touches(module, source, fields)
    ]
    found = [
        t for t in found if not t.startswith("tests/unit/test_decisions.py") or "budgets.record" not in t
    ]
    assert found == []
    assert touches(OWNER, (ROOT / OWNER).read_text(), fields)  # the scan sees the owner's own uses


def test_a_write_from_elsewhere_is_reported():
    fields, sources = state_fields(), tree_sources()
    mutations = {
        "runtime/driver.py": "self.ft._events.append(('trained', 0))",
        "runtime/roles.py": "ft._restarts['learner'] += 1",
        "faults/audit.py": "driver.ft._last_store_error = ''",
        "launch/cmd_train.py": "ft._budgets.record('learner', 0, 'x')",
    }
    for module, line in mutations.items():
        mutated = sources[module] + f"\n\ndef _mutant(self, ft, driver):\n    {line}\n"
        assert touches(module, mutated, fields) != touches(module, sources[module], fields), module
