"""Waiting for a condition instead of sleeping a fixed time: a test proceeds as soon as what it waits
for is true, and fails with ``what`` when it is not true within ``timeout`` seconds.

Fixed sleeps stay only where a test checks that nothing happens within a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.005


def wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` until it is truthy; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not met within {timeout} s"
        time.sleep(POLL_S)


async def async_wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """``wait_for`` inside an event loop: polls without blocking the loop, so the awaited work runs."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not met within {timeout} s"
        await asyncio.sleep(POLL_S)
