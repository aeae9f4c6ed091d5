"""The README's map of the code ("Where things happen") is true: each chain of calls from `launch/cli.py:main`
exists as written — every named function exists and its body calls the next one — has at most 6 calls, and
never goes back up a layer.

A link counts only as a call: `name(…)`, `x.name(…)`, or the role method a call through Ray names as its
first argument (`handle.call(BackupRole.run_once, …)`, `group.call(LearnerRole.train_step, …)`,
`_call(StoreRole.put_raw, …)`, `roles.sample(SamplerRole.sample_and_commit, …)`: runtime/remote.py). A name
that merely appears (`cfg.run`, a string in a message) is no call: with it counted, the chain still held
after `driver.run(…)` was deleted from `launch/cmd_train.py:run`, which a test here checks can no longer
happen."""

import ast
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# launch (the commands) → runtime → the roles (actors, learner) → storage → system
LAYER = {"launch": 0, "runtime": 1, "actors": 2, "learner": 2, "storage": 3, "system": 4}
FUNCTION = ast.FunctionDef | ast.AsyncFunctionDef
ARROW = re.compile(r"\s*(→|⇢)\s*")
# a role method named as an argument (`SamplerRole.sample_and_commit`): what a call through Ray reaches
ROLE_METHOD = re.compile(r"^[A-Z]\w*Role$")


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


def function_node(ref: str, source: str | None = None) -> ast.AST:
    """The def of `path/to/module.py:Qualname` (a function, or Class.method) in that file (or in `source`,
    the text of that file as a test changed it)."""
    module, qualname = ref.split(":")
    tree = ast.parse(source if source is not None else (ROOT / module).read_text())
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, FUNCTION | ast.ClassDef) and n.name == part), None)
        assert node is not None, f"{ref}: no {part} in {module}"
        scope = node.body  # type: ignore[attr-defined]
    assert isinstance(node, FUNCTION), f"{ref} is not a function"
    return node


def called_names(node: ast.AST) -> set[str]:
    """The names `node`'s body calls (see the module docstring), nothing that is only mentioned."""
    names: set[str] = set()
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        func = call.func
        if isinstance(func, ast.Attribute):
            called = func.attr
        else:
            called = func.id if isinstance(func, ast.Name) else ""  # "": a call of what a call returned
        names.add(called)
        first = (
            call.args[0] if call.args else None
        )  # `handle.call(BackupRole.run_once, …)`: the role's method
        if isinstance(first, ast.Attribute) and ROLE_METHOD.match(getattr(first.value, "id", "")):
            names.add(first.attr)
    return names


def missing_links(chain: list[str], sources: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The (caller, callee) pairs of `chain` whose caller does not call the callee; `sources`: module
    path → the text to read instead of that file."""
    sources = sources or {}
    missing = []
    for caller, callee in itertools.pairwise(chain):
        function_node(callee, sources.get(callee.split(":")[0]))  # exists
        name = callee.split(":")[1].split(".")[-1]
        if name not in called_names(function_node(caller, sources.get(caller.split(":")[0]))):
            missing.append((caller, callee))
    return missing


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
        assert missing_links(chain) == [], f"{what}: these callers do not call the next"


class _DropCalls(ast.NodeTransformer):
    """Replaces each call `<x>.<method>(arg, …)` by its first argument: the call is gone, the names in its
    arguments stay (`driver.run(cfg.run.steps)` → `cfg.run.steps`)."""

    def __init__(self, method: str) -> None:
        self.method = method

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == self.method:
            return node.args[0] if node.args else ast.Constant(None)
        return node


def test_a_deleted_call_breaks_its_link_though_the_name_remains():
    """Chain (a) with `driver.run(…)` taken out of `launch/cmd_train.py:run`: `run` is still a name in
    that body (`cfg.run.steps`, `cfg.run.run_dir`), but no longer a call, and the link is reported."""
    chain = readme_chains()["(a)"]
    caller, callee = "launch/cmd_train.py:run", "runtime/driver.py:Driver.run"
    assert (caller, callee) in itertools.pairwise(chain)
    module = caller.split(":")[0]
    tree = _DropCalls("run").visit(ast.parse((ROOT / module).read_text()))
    cut = ast.unparse(ast.fix_missing_locations(tree))
    body = function_node(caller, cut)
    assert "run" in {n.attr for n in ast.walk(body) if isinstance(n, ast.Attribute)}  # the name remains
    assert "run" in called_names(function_node(caller))  # the file as it is: the link holds
    assert missing_links(chain, {module: cut}) == [(caller, callee)]


def test_a_role_method_counts_only_as_the_first_argument_of_a_call():
    node = ast.parse(
        "def f(group, store, log, ft, step):\n"
        "    group.call(LearnerRole.train_step, LearnerRole.stop)\n"
        "    ft.store.call(StoreRole.release, 4)\n"
        "    store.backup.call(BackupRole.run_once, 64)\n"
        "    log.info('put_raw', cfg.sample_and_commit)\n"
        "    x = StoreRole.close\n"
    ).body[0]
    names = called_names(node)
    assert names == {"call", "train_step", "release", "run_once", "info"}


def test_no_chain_goes_back_up_a_layer():
    for what, chain in readme_chains().items():
        layers = [LAYER[ref.split("/")[0]] for ref in chain]
        assert layers == sorted(layers), f"{what}: {list(zip(chain, layers, strict=True))}"
