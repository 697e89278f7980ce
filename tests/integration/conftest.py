"""Fixtures of the integration tier shared by several test modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny reverse-task model with random weights (the plumbing is tested, not the learning)."""
    out = tmp_path_factory.mktemp("model") / "reverse-tiny"
    subprocess.run([sys.executable, "-m", "services", "init-model", "--task", "reverse", "--out", str(out),
                    "--warm-steps", "0", "--threads", "1"], cwd=REPO, check=True, capture_output=True, timeout=180)
    return out
