"""What the collector decides for a rollout entry: the action types and THE retry policy (pure).

``retry_or_dead_letter`` is the pipeline's only retry policy: workers hand every attempt over
(completed or failed, with ``error_code`` and ``retryable``), and only the collector re-enqueues
or dead-letters. Infrastructure failures never get here (the worker keeps them pending), so every
failure this policy sees spends one of the group's attempts.

Every non-poison rollout entry leaves the collector through exactly one action:

* ``BatchOut``      — in one trainer batch (with the other members of the batch);
* ``Reenqueue``     — dropped (stale window, or failed and retryable) and sent back to
                      ``{p}:prompts`` as attempt + 1 of the same ``group_id``;
* ``DeadLetterOut`` — dropped with no retries left (``stale_retries_exhausted`` /
                      ``retries_exhausted``), or not retriable (``invalid_prompt_group``,
                      ``missing_prompt_group``);
* ``Discard``       — a copy of a ``group_id:attempt`` that already has an outcome (late duplicate).

Each action carries the ``{p}:stats`` increments, the ``group_id:attempt`` keys it marks done and
the group ids it closes (trained or dead-lettered: no later attempt may be trained), so the shell
commits it in one MULTI/EXEC with the output XADD and the XACK.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from shared import codes, stats
from shared.schemas import MAX_ERROR_CHARS, Batch, PromptGroup, RetryRecord, RolloutGroup

STALE_NOTE = "stale: outside the version window"  # the error text of a window drop


@dataclass(frozen=True)
class Arrival:
    """A decoded rollout entry still pending in ``{p}:rollouts``."""

    entry_id: bytes
    group: RolloutGroup
    fields: Mapping[bytes, bytes] = field(default_factory=dict)  # original bytes, for dead letters

    @property
    def key(self) -> str:
        return done_key(self.group.group_id, self.group.attempt)


def done_key(group_id: str, attempt: int) -> str:
    """Member of ``{p}:collector:done``: one outcome per attempt of a group."""
    return f"{group_id}:{attempt}"


@dataclass
class _Action:
    stats: dict[str, int]

    @property
    def arrivals(self) -> list[Arrival]:
        raise NotImplementedError

    @property
    def done_keys(self) -> list[str]:
        return [a.key for a in self.arrivals]

    @property
    def closed_ids(self) -> list[str]:
        return []


@dataclass
class BatchOut(_Action):
    batch: Batch
    members: list[Arrival]
    metrics: dict[str, float]  # staleness/* metrics of this batch

    @property
    def arrivals(self) -> list[Arrival]:
        return self.members

    @property
    def closed_ids(self) -> list[str]:
        return [a.group.group_id for a in self.members]


@dataclass
class _Single(_Action):
    arrival: Arrival

    @property
    def arrivals(self) -> list[Arrival]:
        return [self.arrival]


@dataclass
class Reenqueue(_Single):
    prompt: PromptGroup  # attempt + 1, fresh enqueued_at
    why: Literal["stale", "failed"]


@dataclass
class DeadLetterOut(_Single):
    reason: str
    error: str

    @property
    def closed_ids(self) -> list[str]:
        return [self.arrival.group.group_id]


@dataclass
class Discard(_Single):
    why: str  # "done" | "closed" | "waiting"

    @property
    def done_keys(self) -> list[str]:
        return []  # marks nothing: the original outcome already did


Action = BatchOut | Reenqueue | DeadLetterOut | Discard


def rejection_stats(group: RolloutGroup) -> dict[str, int]:
    """``partial_rollout_rejected_*`` increments for one failed event: its own ``error_code`` only,
    so one rejection is counted once and no later failure of the group inherits it."""
    if group.status != "failed" or group.error_code != codes.STALENESS_EXCEEDED:
        return {}
    n = group.prompt_group.n_samples if group.prompt_group else len({s.traj_id for s in group.samples})
    return {stats.REJECTED_GROUPS: 1, stats.REJECTED_SAMPLES: n}


def _dead(arrival: Arrival, reason: str, error: str, extra: dict[str, int]) -> DeadLetterOut:
    counters = {stats.GROUPS_DEAD_LETTERED: 1, stats.dead_lettered_by(reason): 1, **extra}
    return DeadLetterOut(counters, arrival, reason, error[:MAX_ERROR_CHARS])


def retry_or_dead_letter(arrival: Arrival, why: Literal["stale", "failed"], max_retries: int,
                         now: float) -> Reenqueue | DeadLetterOut:
    """Re-enqueue attempt + 1 while ``attempt < max_retries`` and a retry can help, else dead-letter.

    ``why``: ``stale`` (dropped by the window) or ``failed`` (the attempt failed; ``retryable``
    False dead-letters at once as ``invalid_prompt_group``). The re-enqueued prompt gets a fresh
    ``enqueued_at`` and one ``RetryRecord`` more.
    """
    group = arrival.group
    extra: dict[str, int] = {stats.GROUPS_DROPPED_STALE: 1} if why == "stale" else {}
    if why == "failed":
        extra.update(rejection_stats(group))
    prompt = group.prompt_group
    if prompt is None:
        return _dead(arrival, codes.MISSING_PROMPT_GROUP,
                     "RolloutGroup.prompt_group is missing; cannot re-enqueue", extra)
    error = STALE_NOTE if why == "stale" else (group.error or group.error_code or "failed")
    if why == "failed" and not group.retryable:  # a task error keeps its own reason; anything else: invalid group
        reason = codes.TASK_ERROR if group.error_code == codes.TASK_ERROR else codes.INVALID_PROMPT_GROUP
        return _dead(arrival, reason, error, extra)
    if group.attempt < max_retries:
        record = RetryRecord(attempt=group.attempt, reason=why, error=error[:MAX_ERROR_CHARS], at=now)
        retry = prompt.model_copy(update={"attempt": group.attempt + 1, "enqueued_at": now,
                                          "retry_history": [*prompt.retry_history, record]})
        return Reenqueue({stats.GROUPS_REENQUEUED: 1, stats.reenqueued_by(why): 1, **extra}, arrival, retry, why)
    reason = codes.STALE_RETRIES_EXHAUSTED if why == "stale" else codes.RETRIES_EXHAUSTED
    return _dead(arrival, reason, f"attempt {group.attempt} of max_retries {max_retries}: {error}", extra)
