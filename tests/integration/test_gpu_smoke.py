"""``bench/gpu_smoke.py --device cpu``: every check of the GPU smoke script passes on the CPU, so it cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from paths import REPO

# The end-to-end run's trainer steps on CPU (the GPU runs 50). Its criterion, the held-out answer loss under the
# last checkpoint against version 0, fell by 0.08 every 10 steps (0.624, 0.542, 0.512, 0.482 at 0/10/20/30).
STEPS = 20


def test_gpu_smoke_passes_every_check_on_cpu(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "bench/gpu_smoke.py", "--device", "cpu", "--steps", str(STEPS),
                           "--work", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1] == "gpu smoke: 5/5 ok", proc.stdout + proc.stderr[-3000:]
    assert [line.split()[1] for line in lines if line.startswith(("ok ", "FAIL "))] == \
        ["trainer", "precision", "logprobs", "serving", "e2e"]
