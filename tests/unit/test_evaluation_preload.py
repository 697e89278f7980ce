"""The eval worker preloads what a job imports, so rq's forked work horses inherit it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.trainer_factory import tiny_model

HEAVY = ("torch", "transformers", "transformers.models.qwen3.modeling_qwen3", "shared.modeling", "shared.tasks")
PROBE = f"""
import json, sys, threading
from shared.evaluation import preload
heavy = {HEAVY!r}
before = [m for m in heavy if m in sys.modules]
missing = preload(sys.argv[2])  # a model not built yet: the libraries only, no error
got = preload(sys.argv[1])
print(json.dumps({{"before": before, "after": [m for m in heavy if m in sys.modules], "reported": "torch" in missing,
                  "threads": threading.active_count()}}))
"""


def test_preload_imports_torch_transformers_and_the_architecture_without_starting_threads(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", PROBE, str(model), str(tmp_path / "not-built-yet")],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == []  # importing shared.evaluation alone pulls in none of the job's heavy modules
    assert got["after"] == list(HEAVY)
    assert got["reported"] is True
    assert got["threads"] == 1  # no thread that a fork would leave behind in the work horse
    assert "not imported" in out.stderr  # the unreadable model is logged, not raised
