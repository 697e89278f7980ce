"""The engine and proxy ports of a local deployment, claimed so that runs side by side never share one.

Checking that a port binds and binding it later is a race: two ``dressage up`` started together (the
experiment harness with ``--jobs``, two test processes) both find 8800 free, and the second proxy dies on
``EADDRINUSE``. A run therefore also *claims* each port with an advisory lock on
``<claims dir>/<host>-<port>.lock`` (``fcntl.flock``), held by the ``dressage up`` process for the whole run
and released by the kernel when that process ends, however it ends. A port is used only when its claim
succeeds and it binds; otherwise a free port the OS hands out is claimed instead.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import IO

from shared.redisproc import free_port

log = logging.getLogger(__name__)
ATTEMPTS = 50  # free ports tried before giving up (each one the OS's pick)


class NoFreePort(RuntimeError):
    """No port could be both claimed and bound on the host; names the host and the claims directory."""


def default_claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / "dressage-ports"


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class PortClaims:
    """The ports one run holds; ``release()`` (or the process's end) gives them back."""

    def __init__(self, directory: Path | None = None) -> None:
        self.dir = directory or default_claims_dir()
        self._held: list[IO[bytes]] = []

    def _lock(self, host: str, port: int) -> IO[bytes] | None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fh = (self.dir / f"{host}-{port}.lock").open("ab")
        except OSError:  # another user's claim file (or no claims directory): not ours to take
            return None
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            return None
        return fh

    def claim(self, host: str, port: int) -> int:
        """``port`` when no other run claims it and it binds on ``host``; else a free one, claimed the same way."""
        candidates = [port] + [0] * ATTEMPTS
        for wanted in candidates:
            candidate = wanted or free_port(host)
            fh = self._lock(host, candidate)
            if fh is None:
                continue
            if _binds(host, candidate):
                self._held.append(fh)
                if candidate != port:
                    log.info("port %d on %s is taken or claimed by another run: using %d (pid %d)", port, host,
                             candidate, os.getpid())
                return candidate
            fh.close()
        raise NoFreePort(f"no port on {host} could be claimed in {self.dir} and bound after {ATTEMPTS} tries")

    def release(self) -> None:
        for fh in self._held:
            fh.close()
        self._held.clear()
