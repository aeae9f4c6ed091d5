"""Results blocks (tools/readme_results.py) in README.md and docs/*.md are exactly the results files, never
typed."""

from pathlib import Path

from tools.readme_results import BLOCK, ROOT, render, stale, targets


def test_every_file_with_blocks_matches_its_results_files():
    blocks = {p.relative_to(ROOT).as_posix(): BLOCK.findall(p.read_text()) for p in targets()}
    named = {m[1] for found in blocks.values() for m in found}
    assert len(blocks["README.md"]) >= 1  # the demo
    assert len(blocks["docs/results.md"]) >= 3
    # the benchmarks, the paper table, the tuning grid
    assert {f"benchmarks/results/{n}.md" for n in ("bench", "paper_table", "paper_tune")} <= named
    bad = [p.relative_to(ROOT).as_posix() for p in stale()]
    assert not bad, f"results blocks differ from their files in {bad}: run `make readme`"


def test_render_fills_a_block_from_a_file(tmp_path: Path):
    (tmp_path / "r.md").write_text("# title\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    readme = "intro\n<!-- results: r.md -->\nstale\n<!-- /results -->\nend\n"
    assert render(readme, root=tmp_path) == (
        "intro\n<!-- results: r.md -->\n| a | b |\n|---|---|\n| 1 | 2 |\n<!-- /results -->\nend\n"
    )


def test_a_docs_page_block_is_checked_and_its_image_links_are_rebased(tmp_path: Path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.md").write_text("# title\n\nfigure 1\n\n![c](c.png)\n")
    (tmp_path / "docs").mkdir()
    block = "<!-- results: results/r.md -->\nstale\n<!-- /results -->\n"
    (tmp_path / "README.md").write_text(block)
    (tmp_path / "docs" / "page.md").write_text("# page\n\n" + block)
    assert stale(tmp_path) == [tmp_path / "README.md", tmp_path / "docs" / "page.md"]

    readme = render(block, tmp_path, tmp_path)
    page = render("# page\n\n" + block, tmp_path, tmp_path / "docs")
    assert "![c](results/c.png)" in readme and "figure 1" in readme
    assert "![c](../results/c.png)" in page and "figure 1" in page
    (tmp_path / "README.md").write_text(readme)
    assert stale(tmp_path) == [tmp_path / "docs" / "page.md"]  # a stale docs page alone still fails the check
    (tmp_path / "docs" / "page.md").write_text(page)
    assert stale(tmp_path) == []
