"""The README's results blocks, rendered from the results files so that no figure in them is typed by hand.

    python -m launch.readme_results            # rewrite README.md's blocks (`make readme`)
    python -m launch.readme_results --check    # exit 1 if a block differs from its file (a test runs this)

A block is the text between `<!-- results: PATH -->` and `<!-- /results -->`; it holds PATH's content
without its first `# ` title line (PATH is a markdown file written by `make bench` or `treeopsd experiment`,
relative to the repository root; image links are made relative to the README).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- results: (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def block_text(path: Path, root: Path = ROOT) -> str:
    """`path`'s markdown without its title, image links rebased onto the README's folder."""
    lines = path.read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    text = "\n".join(lines).strip() + "\n"
    folder = path.parent.relative_to(root).as_posix()
    if folder == ".":
        return text
    return re.sub(r"\]\((?!https?:|/)([^)]+\.png)\)", rf"]({folder}/\1)", text)


def render(readme: str, root: Path = ROOT) -> str:
    def fill(m: re.Match[str]) -> str:
        path = root / m["path"]
        if not path.exists():
            raise FileNotFoundError(f"README block names {m['path']}, which does not exist")
        return m.group(1) + block_text(path, root) + m.group(4)

    return BLOCK.sub(fill, readme)


def main(argv: list[str]) -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print("README.md results blocks differ from their files: run `make readme`", file=sys.stderr)
            return 1
        return 0
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
