"""The install that `make` did: a CPU build of torch where CI asks for one (scripts/install-cpu-torch.sh)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paths import REPO

SCRIPT = REPO / "scripts" / "install-cpu-torch.sh"


@pytest.mark.skipif(os.environ.get("DRESSAGE_EXPECT_CPU_TORCH") != "1", reason="DRESSAGE_EXPECT_CPU_TORCH unset")
def test_the_venv_holds_the_cpu_build_of_torch() -> None:
    """.ci/run sets DRESSAGE_EXPECT_CPU_TORCH=1: a CUDA build here means the install fell back."""
    assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build ({torch.version.cuda})"
    assert torch.__version__.endswith("+cpu"), torch.__version__


def test_the_install_script_keeps_an_installed_cpu_build(tmp_path: Path) -> None:
    """Run twice (make's stamp changes with pyproject.toml), the script does nothing the second time."""
    if torch.version.cuda is not None:
        pytest.skip("this venv holds a CUDA build")
    out = subprocess.run(
        ["bash", str(SCRIPT), sys.executable],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and "WARNING" not in out.stderr


def test_the_install_script_refuses_a_cuda_fallback_when_told_to(tmp_path: Path) -> None:
    """No CPU wheel anywhere and DRESSAGE_TORCH_ALLOW_CUDA=0: exit 1 naming what it looked for."""
    fake = tmp_path / "python"
    # A stand-in interpreter whose `import torch` fails and whose pip finds nothing: the script's own logic.
    fake.write_text("#!/usr/bin/env bash\nexit 1\n")
    fake.chmod(0o755)
    out = subprocess.run(
        ["bash", str(SCRIPT), str(fake)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DRESSAGE_TORCH_ALLOW_CUDA": "0"},
    )
    assert out.returncode == 1
    assert "no CPU build of torch==2.13.0" in out.stderr
