"""Group assembly: proxy-recorded segments + verifier rewards -> one ``completed`` RolloutGroup,
or a failure -> one ``failed`` RolloutGroup for the collector's retry policy.

Pure functions, no I/O. Invariants:
* every trajectory contributes its segments sorted by ``segment_index`` (duplicates refused);
* the trajectory reward sits on its LAST segment, every earlier segment carries 0.0;
* ``prompt_group`` holds the PromptGroup as sent, so the collector can re-enqueue it;
* a failed group carries the failure's ``error_code`` and ``retryable`` flag and no samples.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from services.rollout_worker.errors import TrajectoryFailed
from shared.schemas import MAX_ERROR_CHARS, PromptGroup, RolloutGroup, Sample

_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+=-]")
MAX_GROUP_PART = 200  # keeps the whole id within the proxy's 256 characters


def session_id(group: PromptGroup, index: int, token: str | None = None) -> str:
    """Proxy session id of trajectory ``index``: ``{group_id}-a{attempt}-s{index}-{short uuid}``.

    The proxy accepts ``[A-Za-z0-9._:@+=-]{1,256}`` starting with a letter or digit: other characters
    of the group id become ``_`` and a long group id is cut (the uuid keeps the id unique).
    """
    part = _UNSAFE.sub("_", group.group_id)[:MAX_GROUP_PART]
    if not part[:1].isalnum():
        part = "g" + part
    return f"{part}-a{group.attempt}-s{index}-{token or uuid.uuid4().hex[:8]}"


@dataclass
class TrajectoryResult:
    """One finished trajectory: its recorded segments (reward already placed) and its score."""

    session_id: str
    reward: float
    correct: bool
    turns: int  # assistant replies the verifier saw
    samples: list[Sample] = field(default_factory=list)
    components: dict[str, float] = field(default_factory=dict)  # the task's named reward parts
    agent_reward: str | None = None  # an agent reported a reward: "accepted" or "refused" by the task; None: none


def finalize_samples(session: str, raw_samples: Any, reward: float) -> list[Sample]:
    """Validate the proxy's Sample dicts of one session, order them, and place the reward.

    Raises ``TrajectoryFailed("no_samples_recorded" | "invalid_samples")``.
    """
    if not isinstance(raw_samples, list) or not raw_samples:
        raise TrajectoryFailed("no_samples_recorded", "the proxy recorded no model call for this trajectory",
                               session_id=session)
    samples: list[Sample] = []
    for i, raw in enumerate(raw_samples):
        if isinstance(raw, dict) and not raw.get("traj_id"):
            raw = {**raw, "traj_id": session}
        try:
            samples.append(Sample.model_validate(raw))
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first.get("loc", ()))
            raise TrajectoryFailed("invalid_samples", f"samples[{i}].{loc}: {first.get('msg')}",
                                   session_id=session) from exc
    samples.sort(key=lambda s: s.segment_index)
    indices = [s.segment_index for s in samples]
    if len(set(indices)) != len(indices):
        raise TrajectoryFailed("invalid_samples", f"duplicate segment_index in {indices}", session_id=session)
    for s in samples:
        s.reward = 0.0
    samples[-1].reward = float(reward)
    return samples


def completed_group(group: PromptGroup, results: Sequence[TrajectoryResult], consumer: str,
                    started_at: float, finished_at: float, agent: str) -> RolloutGroup:
    """The ``completed`` RolloutGroup of one attempt, trajectories in index order."""
    samples = [s for r in results for s in r.samples]
    return RolloutGroup(
        group_id=group.group_id, prompt_id=group.prompt_id, attempt=group.attempt, status="completed",
        error=None, samples=samples, prompt_group=group,
        meta={"task": group.task, "n_samples": group.n_samples, "rollout_started_at": started_at,
              "rollout_finished_at": finished_at, "worker": consumer,
              "agent": agent, "sessions": [r.session_id for r in results],
              "rewards": [r.reward for r in results], "correct": [r.correct for r in results],
              "turns": [r.turns for r in results], **_components(results),
              "agent_rewards": {"accepted": sum(r.agent_reward == "accepted" for r in results),
                                "refused": sum(r.agent_reward == "refused" for r in results)}})


def _components(results: Sequence[TrajectoryResult]) -> dict[str, Any]:
    """``reward_components``: each named part's values by trajectory (None where one lacks it); {} without any."""
    names = sorted({n for r in results for n in r.components})
    if not names:
        return {}
    return {"reward_components": {n: [r.components.get(n) for r in results] for n in names}}


def failed_group(group: PromptGroup, failure: TrajectoryFailed, consumer: str,
                 started_at: float, finished_at: float) -> RolloutGroup:
    """The ``failed`` RolloutGroup of one attempt: the collector decides whether it is retried."""
    return RolloutGroup(
        group_id=group.group_id, prompt_id=group.prompt_id, attempt=group.attempt, status="failed",
        error=failure.text[:MAX_ERROR_CHARS], error_code=failure.code, retryable=failure.retryable,
        prompt_group=group, samples=[],
        meta={"task": group.task, "n_samples": group.n_samples, "rollout_started_at": started_at,
              "rollout_finished_at": finished_at, "worker": consumer})
