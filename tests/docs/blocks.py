"""Find the fenced code blocks of README.md and docs/*.md, with the marker comments right before each.

Markers (HTML comments on the lines right before the fence, so the rendered page does not show them):
`<!-- not-run: REASON -->`, `<!-- tiny: OLD => NEW; ... -->`, `<!-- before: PYTHON -->`
(docs/contributing.md describes them for page authors)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_LANGS = {"python": "python", "py": "python", "yaml": "yaml", "yml": "yaml", "bash": "bash", "sh": "bash",
             "shell": "bash", "console": "bash"}
MARKER = re.compile(r"^<!--\s*(not-run|tiny|before)\s*:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(```+)\s*([\w+-]*)")


@dataclass
class Block:
    page: str             # path relative to the repository
    line: int             # 1-based line of the opening fence
    lang: str             # normalised: python | yaml | bash | the fence's own word
    code: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def runnable_code(self) -> str:
        """The code with the `tiny` replacements applied; each OLD must occur, so a marker cannot
        silently outlive the text it shrinks."""
        code = self.code
        for pair in filter(None, (p.strip() for p in self.markers.get("tiny", "").split(";"))):
            old, sep, new = (s.strip() for s in pair.partition("=>"))
            if not sep or old not in code:
                raise AssertionError(f"{self.id}: tiny replacement {pair!r} does not match the block")
            code = code.replace(old, new)
        return code


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        ticks, word = opening.group(1), opening.group(2).lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        if end is None:
            raise AssertionError(f"{path.name}:{i + 1}: code fence never closed")
        markers: dict[str, str] = {}
        k = i - 1
        while k >= 0 and MARKER.match(lines[k]):
            kind, value = MARKER.match(lines[k]).groups()
            markers[kind] = value
            k -= 1
        found.append(Block(str(path.relative_to(REPO)), i + 1, RUN_LANGS.get(word, word), "\n".join(lines[i + 1:end]) + "\n",
                           markers))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]
