"""The code blocks of Kiln's docs, read as a reader copies them, so that tests check each with
its own tool (amtool, kubectl, a shell) instead of a restated copy. Imported as
`support.snippets`, like the other helpers in tests/support/.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def blocks(doc: str | Path, lang: str, heading: str | None = None) -> list[str]:
    """The fenced `lang` blocks (```lang) of `doc` (a path in the repository), in order: all of
    them, or those under `heading` (its whole text, without the #s) up to the next heading of
    the same or a higher level."""
    level, found, fence, indent, body = 0, [], None, 0, []
    for line in (REPO / doc).read_text().splitlines(keepends=True):
        if fence is not None:  # inside a block: a "# comment" there is no heading
            if line.strip() == "```":
                if fence == lang and (level or heading is None):
                    found.append("".join(body))
                fence = None
            else:
                body.append(line[indent:])  # a block in a list item is indented with it
        elif line.lstrip().startswith("```"):
            fence, indent, body = line.strip()[3:], len(line) - len(line.lstrip()), []
        elif line.startswith("#") and heading is not None:
            hashes = len(line) - len(line.lstrip("#"))
            if level and hashes <= level:
                break
            if line[hashes:].strip() == heading:
                level = hashes
    if heading is not None and not level:
        raise LookupError(f"{doc} has no heading {heading!r}")
    return found
