"""README results blocks (launch/readme_results.py) are exactly the results files, never typed."""

from pathlib import Path

from launch.readme_results import BLOCK, ROOT, render


def test_readme_blocks_match_their_results_files():
    text = (ROOT / "README.md").read_text()
    assert len(BLOCK.findall(text)) >= 3  # the benchmarks, the paper table, the tuning grid
    assert render(text) == text, "README.md results blocks differ from their files: run `make readme`"


def test_render_fills_a_block_from_a_file(tmp_path: Path):
    (tmp_path / "r.md").write_text("# title\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    readme = "intro\n<!-- results: r.md -->\nstale\n<!-- /results -->\nend\n"
    assert render(readme, root=tmp_path) == (
        "intro\n<!-- results: r.md -->\n| a | b |\n|---|---|\n| 1 | 2 |\n<!-- /results -->\nend\n"
    )
