#!/usr/bin/env python
"""Check that every relative link in the README, CONTRIBUTING.md and docs/*.md resolves.

    python tools/check_links.py        # prints each broken link; exit 1 if any

A link resolves when its file exists (relative to the page) and, for ``file.md#anchor`` or
``#anchor``, when the target page has a heading whose GitHub anchor is ``anchor``. Links inside
fenced code blocks and inline code are ignored; ``http(s)://`` and ``mailto:`` links are not
fetched. ``tests/test_config_docs.py`` runs this check in CI.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~)")


def pages(repo: Path = REPO) -> list[Path]:
    """The pages checked: README.md, CONTRIBUTING.md (where present) and docs/*.md."""
    out = [p for p in (repo / "README.md", repo / "CONTRIBUTING.md") if p.exists()]
    return out + sorted((repo / "docs").glob("*.md"))


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, with inline code removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = heading.strip().lower().replace("`", "")
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page`` (duplicates numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            a = anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def broken_links(repo: Path = REPO) -> list[str]:
    """``page: target (why)`` for every relative link that does not resolve."""
    bad = []
    for page in pages(repo):
        for line in _prose_lines(page.read_text()):
            for target in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path_part, _, frag = target.partition("#")
                dest = (page.parent / path_part).resolve() if path_part else page
                rel = page.relative_to(repo)
                if not dest.exists():
                    bad.append(f"{rel}: {target} (no such file)")
                elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                    bad.append(f"{rel}: {target} (no heading with anchor #{frag} in {dest.relative_to(repo)})")
    return bad


def main() -> int:
    bad = broken_links()
    for b in bad:
        print(b)
    n = len(pages())
    print(f"{len(bad)} broken relative link(s) in {n} page(s)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
