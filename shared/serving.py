"""The one way an HTTP service (engine, proxy) serves its ASGI app: one uvicorn worker, graceful stop.

On SIGTERM/SIGINT uvicorn stops accepting, answers the requests in flight, and returns; a second
signal forces the exit. Stock uvicorn then re-raises the signal at the process (exit status -15);
a service that shut down cleanly exits 0 instead, so ``serve`` installs uvicorn's own handler for
the duration of the run and restores the previous one afterwards, without re-raising.

Idle keep-alive connections are kept for ``KEEP_ALIVE_S``, longer than any client pool here keeps
one (httpx expires idle connections after 5 s, uvicorn's default server timeout is also 5 s): with
equal timeouts a client can send a POST on a connection the server is closing at that instant, and
gets a read error for a request that was never seen (a CI run of tests/integration/test_proxy_load.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

SIGNALS = (signal.SIGINT, signal.SIGTERM)
KEEP_ALIVE_S = 75  # > every client's idle expiry (httpx: 5 s), so the client always closes first


class GracefulServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only (a server run in a test thread)
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(app: Any, host: str, port: int) -> None:
    """Serve ``app`` until SIGTERM/SIGINT; returns once the requests in flight were answered."""
    GracefulServer(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                  workers=1, timeout_keep_alive=KEEP_ALIVE_S)).run()
