"""Is the worker's upstream (proxy, engines) available? A small circuit breaker, no I/O.

Invariant: an infrastructure failure (``shared.codes.INFRASTRUCTURE``: proxy refused, 503s, an
engine restarting, timeouts) never spends a group's attempt. Instead the group's entry stays pending
and the breaker opens:

* **open** (``down()`` within the last backoff delay): the worker takes no group at all, new or held;
* **half-open** (the delay has passed): one group at a time probes the upstream — the worker's own
  pending entries come first, so the held groups are the probes;
* **closed** (``up()``: a group got through to the proxy): back to full concurrency, backoff reset.
The delay doubles per consecutive failure from ``first_s`` up to ``max_s`` (``shared.retry.Backoff``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.retry import Backoff


class UpstreamGate:
    def __init__(self, first_s: float = 0.25, max_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._backoff = Backoff(first_s, max_s)
        self._clock = clock
        self._until = 0.0  # monotonic time the open state ends
        self.failures = 0  # consecutive infrastructure failures (0 = closed)

    @property
    def is_down(self) -> bool:
        """Open or half-open: the last group that reached for the upstream found it unavailable."""
        return self.failures > 0

    def down(self) -> float:
        """Record an infrastructure failure; returns the delay before the next probe."""
        self.failures += 1
        delay = self._backoff.next()
        self._until = max(self._until, self._clock() + delay)
        return delay

    def up(self) -> None:
        """A group got through: close the breaker."""
        self.failures = 0
        self._until = 0.0
        self._backoff.reset()

    def slots(self, free: int, in_flight: int) -> int:
        """How many groups the worker may start now, given ``free`` slots and ``in_flight`` groups."""
        if not self.is_down:
            return free
        if self._clock() < self._until:
            return 0
        return min(free, 1) if in_flight == 0 else 0
