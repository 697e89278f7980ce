"""Where the tests find the repository's files (configs, data, examples, docs)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
