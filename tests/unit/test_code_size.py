"""House budgets, checked: every Python file of the project (tests included) ≤ 400 lines, every function ≤ 60
lines (decorators and docstring included). An exception needs an entry here with its reason (at most 3)."""

import ast
from pathlib import Path

from tests.unit.test_import_rules import PACKAGES

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = (*PACKAGES, "examples", "tools", "tests")  # every package of the import rules, and the rest
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60
ALLOWED: dict[str, str] = {}  # "path" or "path:function" -> why it may exceed its budget


def python_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_files_fit_in_400_lines():
    long = {
        rel: n
        for p in python_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
        and (rel := str(p.relative_to(ROOT))) not in ALLOWED
    }
    assert not long, long


def test_functions_fit_in_60_lines():
    long = {}
    for p in python_files():
        rel = str(p.relative_to(ROOT))
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                n = node.end_lineno - start + 1
                if n > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in ALLOWED:
                    long[f"{rel}:{node.lineno} {node.name}"] = n
    assert not long, long


def test_the_allow_list_is_short_and_explained():
    assert len(ALLOWED) <= 3 and all(len(reason) > 20 for reason in ALLOWED.values())
    assert len(python_files()) > 100  # the walk sees the project
