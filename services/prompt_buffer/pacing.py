"""Admission control for prompt groups (AReaL-style pacing), as pure arithmetic on counters.

Contract: with ``max_versions_ahead = η`` and ``v`` the index of the newest published weight
version, the number of groups *ever admitted net of dead letters* never exceeds
``(η + v + 1) × groups_per_version``. Groups that were trained or are still in flight count;
dead-lettered ones do not (they will never be trained, so they free their slot). Hence:

* η = 0 is synchronous on-policy: while version ``v`` is the newest, only the groups that the
  trainer turns into version ``v + 1`` are released; work rolled out by ``v + 1`` waits for it;
* η = None bounds admission only by ``max_in_flight_groups`` (which always applies as well);
* nothing is released before the trainer publishes its first version (``v`` unknown);
* the inputs are persistent Redis counters and the published log, so a trainer or buffer
  restart resumes from the published version with no burst of admissions.

Re-enqueued attempts are not new admissions: they replace a group already counted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PacingInputs:
    version_index: int | None  # index of the newest published version (0 for "0"); None = none yet
    groups_produced: int  # new groups ever emitted (attempt 0), from {p}:stats
    groups_trained: int  # groups the trainer acknowledged, from {p}:stats
    groups_dead_lettered: int  # groups given up after retries, from {p}:stats

    @property
    def admitted(self) -> int:
        """Groups that are trained or still owed to the trainer (dead letters excluded)."""
        return self.groups_produced - self.groups_dead_lettered

    @property
    def in_flight(self) -> int:
        """Groups somewhere between the prompt stream and the trainer."""
        return max(0, self.groups_produced - self.groups_trained - self.groups_dead_lettered)


@dataclass(frozen=True)
class PacingPolicy:
    max_versions_ahead: int | None  # η; None = unbounded by versions
    groups_per_version: int  # train.groups_per_batch × train.update_weights_interval
    max_in_flight_groups: int  # hard cap that always applies

    def __post_init__(self) -> None:
        if self.max_versions_ahead is not None and self.max_versions_ahead < 0:
            raise ValueError(f"pacing.max_versions_ahead must be >= 0 or null, got {self.max_versions_ahead}")
        if self.groups_per_version < 1:
            raise ValueError(f"groups per version must be >= 1, got {self.groups_per_version}")
        if self.max_in_flight_groups < 1:
            raise ValueError(f"pacing.max_in_flight_groups must be >= 1, got {self.max_in_flight_groups}")

    def allowed_total(self, version_index: int) -> int | None:
        """Groups that may have been admitted (net of dead letters) once ``version_index`` is out."""
        if self.max_versions_ahead is None:
            return None
        return (self.max_versions_ahead + version_index + 1) * self.groups_per_version

    def capacity(self, state: PacingInputs) -> int:
        """How many new groups may be emitted now (>= 0)."""
        if state.version_index is None:
            return 0  # the trainer has not published its initial weights yet
        room = self.max_in_flight_groups - state.in_flight
        allowed = self.allowed_total(state.version_index)
        if allowed is not None:
            room = min(room, allowed - state.admitted)
        return max(0, room)


def groups_per_version(groups_per_batch: int, update_weights_interval: int) -> int:
    """Groups the trainer consumes between two published versions."""
    return groups_per_batch * update_weights_interval
