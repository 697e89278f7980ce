"""Retry policy for failed prompt groups: pure functions over plain values, no I/O.

Invariant: a failed attempt ``k`` of a group leaves exactly one way — re-enqueued as attempt
``k + 1`` while ``k < max_retries`` (so at most ``1 + max_retries`` attempts), otherwise
dead-lettered with reason ``retries_exhausted``; a failure no retry can fix (``retryable`` False)
is dead-lettered at once with reason ``invalid_prompt_group``.

Staleness rejections are classified from the failing event's own error code only — never from
``meta.retry_history`` or any earlier attempt — so one rejection is counted once and an
unrelated later failure of the same group is never counted as one (reference §9.5–9.7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from services.rollout_worker.errors import STALENESS_EXCEEDED
from shared.schemas import PromptGroup, RolloutGroup

REASON_EXHAUSTED = "retries_exhausted"
REASON_INVALID = "invalid_prompt_group"
MAX_ERROR_CHARS = 1000  # error text kept on the wire (history entries, failed groups)

REJECTED_GROUPS = "staleness/partial_rollout_rejected_groups"
REJECTED_SAMPLES = "staleness/partial_rollout_rejected_samples"


@dataclass(frozen=True)
class RetryDecision:
    """What to do with a failed attempt."""

    action: Literal["reenqueue", "dead_letter"]
    error: str  # the failing event's error text (truncated)
    reason: str | None = None  # dead-letter reason; None when re-enqueued
    next_group: PromptGroup | None = None  # the attempt + 1 to enqueue; None when dead-lettered

    @property
    def handled(self) -> str:
        """``meta.handled`` of the failed RolloutGroup: ``reenqueued`` | ``dead_lettered``."""
        return "reenqueued" if self.action == "reenqueue" else "dead_lettered"


def next_attempt(group: PromptGroup, error: str, now: float) -> PromptGroup:
    """The same prompt group as attempt + 1: fresh ``enqueued_at``, ``meta.retry_history`` appended."""
    history = list(group.meta.get("retry_history") or [])
    history.append({"attempt": group.attempt, "error": error[:MAX_ERROR_CHARS]})
    return group.model_copy(update={"attempt": group.attempt + 1, "enqueued_at": now,
                                    "meta": {**group.meta, "retry_history": history}}, deep=True)


def decide(group: PromptGroup, error: str, max_retries: int, now: float, retryable: bool = True) -> RetryDecision:
    """Re-enqueue attempt + 1 while ``group.attempt < max_retries`` (and retrying can help), else dead-letter."""
    error = error[:MAX_ERROR_CHARS]
    if not retryable:
        return RetryDecision("dead_letter", error, reason=REASON_INVALID)
    if group.attempt < max_retries:
        return RetryDecision("reenqueue", error, next_group=next_attempt(group, error, now))
    return RetryDecision("dead_letter", error, reason=REASON_EXHAUSTED)


def failed_rollout_group(group: PromptGroup, decision: RetryDecision, consumer: str,
                         started_at: float, finished_at: float) -> RolloutGroup:
    """The ``failed`` RolloutGroup that tells the collector what happened (already handled here)."""
    return RolloutGroup(
        group_id=group.group_id, prompt_id=group.prompt_id, attempt=group.attempt, status="failed",
        error=decision.error, samples=[],
        meta={"handled": decision.handled, "dead_letter_reason": decision.reason,
              "prompt_group": group.model_dump(mode="json"), "task": group.task,
              "n_samples": group.n_samples, "rollout_started_at": started_at,
              "rollout_finished_at": finished_at, "worker": consumer})


def staleness_rejection(code: str, n_samples: int) -> dict[str, Any]:
    """Metric increments for one failure event: non-empty only when THIS event is a staleness rejection.

    ``rejected_samples`` counts the trajectories of the rejected group (the whole group is redone).
    """
    if code != STALENESS_EXCEEDED:
        return {}
    return {REJECTED_GROUPS: 1, REJECTED_SAMPLES: n_samples}
