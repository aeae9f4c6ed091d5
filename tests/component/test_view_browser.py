"""`treeopsd view` in a real browser: a short real training run (the tiny model, warm-started for 60 SFT
steps so that its trees branch over several turns), the view command as a child process, Debian's
Chromium driven by Playwright (the system browser; nothing downloaded). The page is checked against the
stored trees: nodes, leaves, branch points, a turn's V, q, the student's p and tokens, keyboard moves, a
filter, a tree that fails to decode, and the static export opened from file://.

The screenshot the README shows (docs/images/view_tree.png) is this test's: run it with
TREEOPSD_README_SHOTS=1 to write it there (otherwise it goes to the test's temporary folder).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from configs.schema import load_config
from launch.cli import main
from launch.cmd_train import prepare_run_dir
from storage.durable import write_atomic
from storage.replay_store import ReplayStore
from storage.tree_codec import encode_trees, table_to_ipc
from system.credit import is_zero_variance
from system.tree import RolloutTree, make_node

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
RUN = ["learner.batch_trees=2", "learner.minibatches=2", "sampler.num_samplers=1", "algo.M=3", "algo.N=2"]
RUN += ["env.max_turns=6", "env.max_turn_tokens=24", "learner.lr=1e-3", "learner.checkpoint_every=100"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not Path(CHROMIUM).exists():  # `make test` installs it (launch/install_chromium.sh)
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: launch/install_chromium.sh did not install it")
        pytest.skip(f"{CHROMIUM} is missing (make test installs it: launch/install_chromium.sh)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),  # a fresh user-data-dir
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1400, "height": 980},
        )
        yield context
        context.close()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """Two TreeOPSD steps of the in-process roles on the briefly warm-started tiny model."""
    from actors.policy.warmstart import warmstart
    from runtime.local import build_local_run

    tmp = tmp_path_factory.mktemp("view-run")
    model = warmstart(tmp / "model", steps=60, n_train=400, eval_per_hop=1, warmup=10, progress=False)
    cfg = load_config(overrides=[f"run.run_dir={tmp / 'run'}", f"model.path={model['model_dir']}", *RUN])
    prepare_run_dir(cfg, resume=False)
    run = build_local_run(cfg, model["model_dir"])
    try:
        for _ in range(2):
            run.step()
    finally:
        run.close()
    broken = RolloutTree(
        "broken", (make_node(0, -1, 0, obs_tokens=[1]), make_node(1, 0, 1, [5], None, [-1.0]))
    )
    segment = tmp / "run" / "store" / "segments" / "000000009999.raw.arrow"
    write_atomic(segment, table_to_ipc(encode_trees([broken])))  # a leaf without reward: fails to decode
    return tmp / "run"


def _serve(run_dir: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "launch.cli", "view", str(run_dir), "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # "treeopsd view: serving RUN at URL (Ctrl-C stops)"
    assert " at http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.split(" at ")[1].split()[0]


def _values(page, name: str) -> float:
    return float(page.get_attribute(f'[data-testid="turn-{name}"]', "data-value"))


def _learner_s(run_dir: Path, tree_id: str, node: int) -> float:
    for path in sorted((run_dir / "learner_turns").glob("*.arrow")):
        rows = pa.ipc.open_file(pa.memory_map(str(path))).read_all().to_pylist()
        for row in rows:
            if row["tree_id"] == tree_id and row["node_id"] == node:
                return row["s"]
    raise AssertionError(f"no learner record of {tree_id} node {node}")


def _stored(run_dir: Path) -> tuple[dict[str, RolloutTree], RolloutTree]:
    """Every good tree of the run, and the largest trained one (it has a learner record)."""
    with ReplayStore(run_dir / "store", create=False, readonly=True) as store:
        ids = [t for t in store.tree_ids() if t != "broken"]
        trees = {t.tree_id: t for t in store.get_trees(ids)}
        trained = set(store.batch_tree_ids(0)) | set(store.batch_tree_ids(1))
    return trees, max((trees[t] for t in trained), key=lambda t: (len(t.nodes), t.tree_id))


def _check_tree(page, tree: RolloutTree) -> list[int]:
    """The drawn tree against the stored one; returns its branch points."""
    page.click(f'#tree-rows tr[data-tree-id="{tree.tree_id}"]')
    page.wait_for_selector("g.node")
    branch = [i for i, kids in enumerate(tree.children) if len(kids) >= 2]
    assert page.locator("g.node").count() == len(tree.nodes)
    assert page.locator("g.node.leaf").count() == tree.num_leaves
    assert page.eval_on_selector_all("g.node.branch", "gs => gs.map(g => +g.dataset.nodeId)") == branch
    facts = {
        k: page.get_attribute(f'[data-testid="facts-{k}"]', "data-value")
        for k in ("nodes", "leaves", "branch")
    }
    assert facts == {
        "nodes": str(len(tree.nodes)),
        "leaves": str(tree.num_leaves),
        "branch": str(len(branch)),
    }
    return branch


def _check_turn(page, run_dir: Path, tree: RolloutTree, turn: int) -> None:
    """A clicked turn's values and tokens against the store and the learner's record; keyboard moves."""
    page.click(f'g.node[data-node-id="{turn}"]')
    page.wait_for_selector(f"#turn-title:has-text('Turn {turn} ')")
    assert _values(page, "V") == tree.credit.V[turn] and _values(page, "q") == tree.credit.q[turn]
    s = _learner_s(run_dir, tree.tree_id, turn)
    assert _values(page, "p") == pytest.approx(1 / (1 + math.exp(-s)), abs=1e-12)
    shown = page.eval_on_selector_all("#turn-tokens span.tok", "ss => ss.map(s => +s.dataset.tokenId)")
    assert shown == tree.nodes[turn].tokens.tolist()
    assert page.inner_text("#turn-obs").strip()  # the tool's answer, decoded with the run's tokenizer
    page.keyboard.press("ArrowDown")  # to the first child and back to the parent
    assert page.get_attribute(f'g.node[data-node-id="{tree.children[turn][0]}"]', "aria-selected") == "true"
    page.keyboard.press("ArrowUp")
    assert page.get_attribute(f'g.node[data-node-id="{turn}"]', "aria-selected") == "true"


def _check_filter_and_broken(page, trees: dict[str, RolloutTree]) -> None:
    page.check("input[name=no_signal]")  # the broken tree has no reward at all: no signal either
    n = sum(map(is_zero_variance, trees.values())) + 1
    page.wait_for_function(f"document.querySelectorAll('#tree-rows tr').length === {n}")
    _open_broken(page)
    assert "fails to decode: TreeValidationError" in page.inner_text("#tree-error")
    assert page.locator("#tree-box").is_hidden()


def _open_broken(page) -> None:
    """Click the broken tree's row until its error line shows: on a loaded machine the list may be drawn
    again under the click (the background index fills in), and a click on the replaced row opens nothing."""
    from playwright.sync_api import TimeoutError as PageTimeout

    for _ in range(4):
        page.click('#tree-rows tr[data-tree-id="broken"]')
        try:
            page.wait_for_selector("#tree-error:not([hidden])", timeout=15_000)
            return
        except PageTimeout:
            continue
    raise AssertionError("the broken tree's error line never showed after 4 clicks")


def test_the_page_shows_the_stored_tree(real_run, browser, tmp_path):
    trees, tree = _stored(real_run)
    proc, url = _serve(real_run)
    try:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        page.wait_for_selector("#status:has-text(' trees')")
        listed = page.eval_on_selector_all("#tree-rows tr", "rs => rs.map(r => r.dataset.treeId)")
        assert sorted(listed) == sorted([*trees, "broken"])
        branch = _check_tree(page, tree)
        _check_turn(page, real_run, tree, next(i for i in branch if i > 0))  # a turn where the tree splits
        shot = tmp_path / "view_tree.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 20_000
        if os.environ.get("TREEOPSD_README_SHOTS"):
            shutil.copyfile(shot, ROOT / "docs" / "images" / "view_tree.png")
        _check_filter_and_broken(page, trees)
        assert not errors
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_the_export_opens_without_a_server(real_run, browser, tmp_path, capsys):
    _, tree = _stored(real_run)
    out = tmp_path / "export"
    assert main(["view", str(real_run), "--export", str(out), "--trees", tree.tree_id]) == 0  # in-process
    assert "1 tree exported" in capsys.readouterr().out
    page = browser.new_page()
    page.goto((out / "index.html").as_uri())  # no server: the data is in static/data.js
    page.wait_for_selector("g.node")
    assert page.locator("g.node").count() == len(tree.nodes)
    assert page.inner_text("#status") == "1 tree in this export"
    page.click(f'g.node[data-node-id="{tree.leaves[0]}"]')
    shown = page.eval_on_selector_all("#turn-tokens span.tok", "ss => ss.map(s => +s.dataset.tokenId)")
    assert shown == tree.nodes[int(tree.leaves[0])].tokens.tolist()
