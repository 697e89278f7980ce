"""Graceful stop: SIGTERM/SIGINT set a flag that loops poll; a second signal forces exit.

Loops check ``stop.is_set`` between units of work, so the unit in hand finishes (or stays pending
in its stream for another consumer to reclaim) and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)


class StopFlag:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._count = 0

    def install(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)
            signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._count += 1
        if self._count > 1:
            log.warning("second signal %s: exiting now", signum)
            raise SystemExit(1)
        log.info("signal %s received: finishing the work in hand, then stopping", signum)
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)
