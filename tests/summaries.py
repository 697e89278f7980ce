"""One-line summaries a tier prints at the end of the run (the compose tier's, the chaos figures' path, ...).

A tier's hooks run in the test process that ran its tests, an xdist worker under `make test`, whose terminal
nobody sees: it writes its line under the run's base temp dir, and tests/conftest.py prints every line found
there from the process that owns the terminal. Under xdist a worker's base temp dir is a folder of the main
process's (``popen-gw0``), so one glob finds them all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SUFFIX = ".summary.txt"


def _basetemp(config: pytest.Config) -> Path:
    return config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined,no-any-return]  # pytest's own, set in every process


def write_summary(config: pytest.Config, name: str, line: str) -> None:
    (_basetemp(config) / f"{name}{SUFFIX}").write_text(line + "\n")


def read_summaries(config: pytest.Config) -> list[str]:
    base = _basetemp(config)
    return [p.read_text().strip() for p in sorted(base.glob(f"*{SUFFIX}")) + sorted(base.glob(f"*/*{SUFFIX}"))]
