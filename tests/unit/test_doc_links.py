"""Every relative link and #anchor in the README, CONTRIBUTING and docs/ resolves (scripts/check_doc_links.py)."""

import subprocess
import sys

from paths import REPO


def test_every_relative_doc_link_resolves() -> None:
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "check_doc_links.py"), *map(str, pages)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
