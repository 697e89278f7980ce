"""Starting the services that load torch from a test: forked from one pre-imported launcher per test process.

``dressage up`` forks the trainer, the engine and the eval worker from tools/deploy/prefork.py's launcher; the
tests that start those services themselves again and again (the trainer's crash protocol, the chaos clusters)
do the same here, so twenty trainer starts import torch once. The launcher starts on first use and dies with
the test process; a forked service is the real service (``python -m`` semantics, its own log, Popen's exit
codes), see tests/unit/test_deploy_prefork.py.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.cli import COMMANDS
from tools.deploy import prefork
from tools.deploy.prefork import ForkedProcess, Launcher, ensure_launcher

TORCH_SERVICES = frozenset(prefork.TORCH_SERVICES)
PRELOADED = tuple(COMMANDS[service][0] for service in prefork.TORCH_SERVICES)
_launcher: Launcher | None = None


def start(module: str, args: Sequence[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedProcess:
    """``python -m module args...`` forked from this test process's launcher; stdout and stderr appended to
    ``log``."""
    global _launcher
    launcher = ensure_launcher(_launcher, sys.executable, PRELOADED)
    if launcher is not _launcher:
        atexit.register(launcher.close)
        _launcher = launcher
    return _launcher.spawn(module, args, env, str(cwd), str(log), 0, None)


@dataclass(frozen=True)
class Finished:
    returncode: int
    output: str  # stdout and stderr together, as the log has them


def run(module: str, args: Sequence[str], env: dict[str, str], cwd: Path, log: Path, timeout: float) -> Finished:
    """``start`` and wait for the exit (killed after ``timeout`` s); the exit code and what it printed."""
    log.unlink(missing_ok=True)
    proc = start(module, args, env, cwd, log)
    try:
        code = proc.wait(timeout)
    finally:
        proc.kill()
    return Finished(code, log.read_text(errors="replace") if log.exists() else "")
