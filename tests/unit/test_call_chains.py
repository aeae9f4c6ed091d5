"""The README's map of the code ("Where things happen") is true: each chain of calls from `launch/cli.py:main`
exists as written — every named function exists and its body calls the next one (by name, as an
attribute, or as the method name a Ray call or the store client sends) — has at most 6 calls, and never
goes back up a layer."""

import ast
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# launch (the commands) → runtime → the roles (actors, learner) → storage → system
LAYER = {"launch": 0, "runtime": 1, "actors": 2, "learner": 2, "storage": 3, "system": 4}
FUNCTION = ast.FunctionDef | ast.AsyncFunctionDef
ARROW = re.compile(r"\s*(→|⇢)\s*")


def readme_chains() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Where things happen", 1)[1].split("\n## ", 1)[0]
    chains = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("("):
            chains[cells[0][:3]] = re.findall(r"`([a-z_/]+\.py:[A-Za-z_.]+)`", cells[1])
            assert len(ARROW.findall(cells[1])) == len(chains[cells[0][:3]]) - 1, line
    return chains


def function_node(ref: str) -> ast.AST:
    """The def of `path/to/module.py:Qualname` (a function, or Class.method) in that file."""
    module, qualname = ref.split(":")
    tree = ast.parse((ROOT / module).read_text())
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, FUNCTION | ast.ClassDef) and n.name == part), None)
        assert node is not None, f"{ref}: no {part} in {module}"
        scope = node.body  # type: ignore[attr-defined]
    assert isinstance(node, FUNCTION), f"{ref} is not a function"
    return node


def called_names(node: ast.AST) -> set[str]:
    names: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            names.add(n.value)  # a Ray call by method name (`call("train_step")`, `_call("put_raw", …)`)
    return names


def test_the_readme_names_four_chains_from_main_of_at_most_six_calls():
    chains = readme_chains()
    assert sorted(chains) == ["(a)", "(b)", "(c)", "(d)"]
    for what, chain in chains.items():
        assert chain[0] == "launch/cli.py:main", what
        assert 2 <= len(chain) - 1 <= 6, f"{what}: {len(chain) - 1} calls"
    # the ends are the functions the README names: the loss, the backup, the commit, the weight load
    ends = {what: chain[-1] for what, chain in chains.items()}
    assert ends == {
        "(a)": "learner/losses.py:treeopsd_loss",
        "(b)": "system/credit.py:credit_rollout_tree",
        "(c)": "storage/replay_store.py:ReplayStore.put_raw",
        "(d)": "actors/weight_gate.py:load_version",
    }


def test_each_function_of_a_chain_calls_the_next():
    for what, chain in readme_chains().items():
        for caller, callee in itertools.pairwise(chain):
            function_node(callee)  # exists
            name = callee.split(":")[1].split(".")[-1]
            assert name in called_names(function_node(caller)), f"{what}: {caller} does not call {name}"


def test_no_chain_goes_back_up_a_layer():
    for what, chain in readme_chains().items():
        layers = [LAYER[ref.split("/")[0]] for ref in chain]
        assert layers == sorted(layers), f"{what}: {list(zip(chain, layers, strict=True))}"
