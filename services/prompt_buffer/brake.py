"""Dead-letter brake: dead letters must never become a drain of the dataset (pure, no I/O).

Contract: with ``per_min`` set, the brake *engages* when the dead letters of the last
``window_s`` seconds reach ``limit = ceil(per_min × window_s / 60)`` (a systemic cause: an
engine serving the wrong weights, a broken reward, an outage that exhausts retries), and
*releases* once they fell to at most ``limit // 2`` (hysteresis: no flapping at the threshold).
While engaged the prompt-buffer admits nothing new, so a persistent cause dead-letters at most
about ``limit`` groups per window instead of the whole dataset; when the cause is gone, the old
dead letters age out of the window and admissions resume by themselves. ``per_min`` None = off.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class BrakePolicy:
    per_min: float | None  # pacing.dead_letter_brake_per_min
    window_s: float  # pacing.dead_letter_brake_window_s

    def __post_init__(self) -> None:
        if self.per_min is not None and self.per_min <= 0:
            raise ValueError(f"pacing.dead_letter_brake_per_min must be > 0 or null, got {self.per_min}")
        if self.window_s <= 0:
            raise ValueError(f"pacing.dead_letter_brake_window_s must be > 0, got {self.window_s}")

    @property
    def enabled(self) -> bool:
        return self.per_min is not None

    @property
    def limit(self) -> int:
        """Dead letters within the window that engage the brake (>= 1)."""
        return max(1, math.ceil((self.per_min or 0.0) * self.window_s / 60.0))

    def engaged(self, was_engaged: bool, recent: int) -> bool:
        """Is the brake on, given its previous state and the dead letters of the window?"""
        if not self.enabled:
            return False
        if recent >= self.limit:
            return True
        return was_engaged and recent > self.limit // 2


def why(reasons: Iterable[str], recent: int, policy: BrakePolicy) -> str:
    """One line for logs, ``dressage status`` and the brake hash: counts and the commonest reasons."""
    top = Counter(reasons).most_common(3)
    causes = ", ".join(f"{r} x{n}" for r, n in top) or "unknown"
    return (f"{recent} dead letters in the last {policy.window_s:.0f}s (brake at {policy.limit}, "
            f"pacing.dead_letter_brake_per_min={policy.per_min:g}): {causes}")
