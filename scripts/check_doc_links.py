#!/usr/bin/env python3
"""Check that every relative markdown link, and its #anchor, in the given files resolves.

    python scripts/check_doc_links.py README.md CONTRIBUTING.md docs/*.md docs/*/*.md

Links inside code spans and fenced blocks are skipped; anchors follow GitHub's rule (lower case, spaces
to hyphens, punctuation dropped, ``<a id="...">`` too). Exit 1 if any link is broken.
"""

from __future__ import annotations

import os
import re
import sys

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.replace("`", "")).strip().lower()
    return "".join("-" if ch == " " else ch for ch in text if ch.isalnum() or ch in "-_ ")


def prose(path: str) -> list[tuple[int, str]]:
    """The lines of ``path`` outside fenced code blocks, numbered."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced:
                out.append((number, line))
    return out


def anchors(path: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose(path):
        if m := HEADING.match(line):
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
        found.update(re.findall(r'<a id="([^"]+)"', line))
    return found


def broken(path: str) -> list[str]:
    out = []
    for number, line in prose(path):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(full):
                out.append(f"{path}:{number}: missing {target}")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                out.append(f"{path}:{number}: no anchor #{anchor} in {full}")
    return out


def main(paths: list[str]) -> int:
    problems = [p for path in paths for p in broken(path)]
    print("\n".join(problems + [f"{len(problems)} broken link(s)"]))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
