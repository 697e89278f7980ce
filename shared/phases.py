"""Where a loop's wall-clock goes: cumulative seconds per named phase, as plain arithmetic.

Invariant: phases never overlap and never nest, so the seconds of all phases plus ``other``
(time outside every phase: logging, metric reports, bookkeeping) equal the wall-clock since
``start`` exactly. A loop wraps each part of its iteration in ``with clock.phase("wait"):``;
``snapshot()`` returns the cumulative seconds, which the trainer reports with every step as
``time/<phase>_s`` plus ``time/wall_s`` (``tools.reports.timing`` turns them into fractions).
The clock is injectable, so the arithmetic is tested without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class PhaseNesting(RuntimeError):
    """A phase was entered while another one was running (the decomposition would count twice)."""


class PhaseClock:
    def __init__(self, phases: tuple[str, ...], clock: Callable[[], float] = time.monotonic) -> None:
        self.phases = phases
        self.clock = clock
        self.started = clock()
        self.seconds: dict[str, float] = dict.fromkeys(phases, 0.0)
        self._current: str | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise KeyError(f"unknown phase {name!r} (known: {', '.join(self.phases)})")
        if self._current is not None:
            raise PhaseNesting(f"phase {name!r} entered inside phase {self._current!r}")
        self._current = name
        t0 = self.clock()
        try:
            yield
        finally:
            self.seconds[name] += self.clock() - t0
            self._current = None

    def wall(self) -> float:
        return self.clock() - self.started

    def snapshot(self, prefix: str = "time/") -> dict[str, float]:
        """``{prefix}<phase>_s`` for every phase, ``{prefix}other_s`` and ``{prefix}wall_s`` (seconds)."""
        wall = self.wall()
        out = {f"{prefix}{name}_s": round(s, 4) for name, s in self.seconds.items()}
        out[f"{prefix}other_s"] = round(max(0.0, wall - sum(self.seconds.values())), 4)
        out[f"{prefix}wall_s"] = round(wall, 4)
        return out
