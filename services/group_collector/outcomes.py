"""What the collector decides for a rollout entry: the action types and the retry policy (pure).

Every non-poison rollout entry leaves the collector through exactly one action:

* ``BatchOut``      — in one trainer batch (with the other members of the batch);
* ``Reenqueue``     — dropped (stale window, or failed without ``meta.handled``) and sent back to
                      ``{p}:prompts`` as attempt + 1 of the same ``group_id``;
* ``DeadLetterOut`` — dropped with no retries left (``stale_retries_exhausted`` /
                      ``retries_exhausted``), or not retriable (``missing_prompt_group``);
* ``Observed``      — a failed group a worker already re-enqueued or dead-lettered (``meta.handled``):
                      seen for the window and metrics, then acknowledged;
* ``Discard``       — a copy of a ``group_id:attempt`` that already has an outcome (late duplicate).

Each action carries the ``{p}:stats`` increments, the ``group_id:attempt`` keys it marks done and
the group ids it closes (trained or dead-lettered: no later attempt may be trained), so the shell
commits it in one MULTI/EXEC with the output XADD and the XACK.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from shared.schemas import Batch, PromptGroup, RolloutGroup

STALE_ERROR = "partial_rollout_staleness_exceeded"  # the proxy's span-limit error code


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
class Observed(_Single):
    handled: str  # "reenqueued" | "dead_lettered" (what the worker did)

    @property
    def closed_ids(self) -> list[str]:
        return [self.arrival.group.group_id] if self.handled == "dead_lettered" else []


@dataclass
class Discard(_Single):
    why: str  # "done" | "closed" | "waiting"

    @property
    def done_keys(self) -> list[str]:
        return []  # marks nothing: the original outcome already did


Action = BatchOut | Reenqueue | DeadLetterOut | Observed | Discard


def original_prompt(group: RolloutGroup) -> PromptGroup | None:
    """The PromptGroup the worker carried in ``meta["prompt_group"]``, or None if absent/invalid."""
    raw = group.meta.get("prompt_group")
    if isinstance(raw, PromptGroup):
        return raw
    if not isinstance(raw, dict):
        return None
    try:
        return PromptGroup.model_validate(raw)
    except ValidationError:
        return None


def has_staleness_failure(group: RolloutGroup) -> bool:
    """True iff this failed event was a partial-rollout span rejection (this event's error only)."""
    return group.status == "failed" and STALE_ERROR in (group.error or "")


def rejection_stats(group: RolloutGroup) -> dict[str, int]:
    """``partial_rollout_rejected_*`` increments for one failed event (counted once, no sticky markers)."""
    if not has_staleness_failure(group):
        return {}
    prompt = original_prompt(group)
    n = prompt.n_samples if prompt else len({s.traj_id for s in group.samples})
    return {"partial_rollout_rejected_groups": 1, "partial_rollout_rejected_samples": n}


def retry_or_dead_letter(arrival: Arrival, why: Literal["stale", "failed"], max_retries: int,
                         now: float) -> Reenqueue | DeadLetterOut:
    """Re-enqueue attempt + 1 while ``attempt < max_retries``, else dead-letter with the reason."""
    group = arrival.group
    extra: dict[str, int] = {"groups_dropped_stale": 1} if why == "stale" else {}
    prompt = original_prompt(group)
    if prompt is None:
        return DeadLetterOut({"groups_dead_lettered": 1, "dead_lettered:missing_prompt_group": 1, **extra},
                             arrival, "missing_prompt_group",
                             "RolloutGroup.meta.prompt_group is missing or invalid; cannot re-enqueue")
    error = "stale: outside the version window" if why == "stale" else (group.error or "failed")
    if group.attempt < max_retries:
        history: list[Any] = list(prompt.meta.get("retry_history") or [])
        history.append({"attempt": group.attempt, "reason": why, "error": error[:500], "at": now})
        retry = prompt.model_copy(update={"attempt": group.attempt + 1, "enqueued_at": now,
                                          "meta": {**prompt.meta, "retry_history": history}})
        return Reenqueue({"groups_reenqueued": 1, f"reenqueued:{why}": 1, **extra}, arrival, retry, why)
    reason = "stale_retries_exhausted" if why == "stale" else "retries_exhausted"
    return DeadLetterOut({"groups_dead_lettered": 1, f"dead_lettered:{reason}": 1, **extra}, arrival, reason,
                         f"attempt {group.attempt} of max_retries {max_retries}: {error}")
