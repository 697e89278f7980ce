"""Waiting for a condition instead of sleeping a fixed time: a test proceeds as soon as what it waits
for is true, and fails with ``what`` when it is not true within ``timeout`` seconds.

Fixed sleeps stay only where a test checks that nothing happens within a time.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.005


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
             why: Callable[[], str] | None = None, *, process: subprocess.Popen[Any] | None = None,
             period: float = POLL_S, ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll ``cond`` until it is truthy and return that value; AssertionError after ``timeout`` seconds.

    ``why()`` adds context to a failure (a log tail); ``process`` fails at once when that process has
    exited (what it waits for can no longer happen); an exception of a type in ``ignore`` counts as
    "not yet" (a server still starting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except ignore:
            value = None
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{what}: the process exited (code {process.returncode}) before it was met"
                                 + _detail(why))
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not met within {timeout} s" + _detail(why))
        time.sleep(period)


def _detail(why: Callable[[], str] | None) -> str:
    return f"\n{why()}" if why is not None else ""


async def async_wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """``wait_for`` inside an event loop: polls without blocking the loop, so the awaited work runs."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not met within {timeout} s"
        await asyncio.sleep(POLL_S)
