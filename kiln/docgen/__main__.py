"""`python -m kiln.docgen [REPO]`: rewrite the generated pages of docs/ (run from the repository root)."""

from __future__ import annotations

import sys
from pathlib import Path

from kiln.config.docs import config_markdown
from kiln.docgen.errors_page import troubleshooting_markdown
from kiln.docgen.format_table import with_format_table
from kiln.docgen.strategy_matrix import matrix_markdown


def pages(repo: Path) -> dict[Path, str]:
    """Each generated page's path and its current text."""
    return {
        repo / "docs" / "config.md": config_markdown(),
        repo / "docs" / "choosing-a-strategy.md": matrix_markdown(repo),
        repo / "docs" / "troubleshooting.md": troubleshooting_markdown(repo / "kiln"),
        repo / "docs" / "checkpoints.md": with_format_table((repo / "docs" / "checkpoints.md").read_text()),
    }


def main(argv: list[str]) -> int:
    repo = Path(argv[0] if argv else ".").resolve()
    for path, text in pages(repo).items():
        path.write_text(text)
        print(f"wrote {path.relative_to(repo)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
