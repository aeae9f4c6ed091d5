"""The results blocks of README.md and of every docs/*.md page, rendered from the results files so that no
figure in them is typed by hand.

    python -m tools.readme_results            # rewrite the blocks of README.md and docs/*.md (`make readme`)
    python -m tools.readme_results --check    # exit 1 if a block differs from its file (a test runs this)

A block is the text between `<!-- results: PATH -->` and `<!-- /results -->`; it holds PATH's content
without its first `# ` title line (PATH is a markdown file written by `make bench` or `treeopsd experiment`,
relative to the repository root, also in a page under docs/; image links are made relative to the folder of
the file that holds the block).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- results: (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def targets(root: Path = ROOT) -> list[Path]:
    """The files whose blocks are rendered: README.md, then every docs/*.md page."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def block_text(path: Path, root: Path = ROOT, base: Path | None = None) -> str:
    """`path`'s markdown without its title, image links rebased onto `base` (a folder; default the root)."""
    lines = path.read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    text = "\n".join(lines).strip() + "\n"
    folder = Path(os.path.relpath(path.parent, root if base is None else base)).as_posix()
    if folder == ".":
        return text
    return re.sub(r"\]\((?!https?:|/)([^)]+\.png)\)", rf"]({folder}/\1)", text)


def render(text: str, root: Path = ROOT, base: Path | None = None) -> str:
    """`text` (the content of a file in `base`, default the root) with every block filled from its file."""

    def fill(m: re.Match[str]) -> str:
        path = root / m["path"]
        if not path.exists():
            raise FileNotFoundError(f"a results block names {m['path']}, which does not exist")
        return m.group(1) + block_text(path, root, base) + m.group(4)

    return BLOCK.sub(fill, text)


def stale(root: Path = ROOT) -> list[Path]:
    """The files (of `targets`) with a block that differs from its results file."""
    out = []
    for p in targets(root):
        text = p.read_text()
        if render(text, root, p.parent) != text:
            out.append(p)
    return out


def main(argv: list[str]) -> int:
    if "--check" in argv:
        bad = stale()
        for p in bad:
            print(
                f"{p.relative_to(ROOT)}: results blocks differ from their files: run `make readme`",
                file=sys.stderr,
            )
        return 1 if bad else 0
    for p in targets():
        text = p.read_text()
        new = render(text, ROOT, p.parent)
        if new != text:
            p.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
