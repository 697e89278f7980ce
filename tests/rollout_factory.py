"""Factories for rollout-side wire objects in tests: small, explicit, one trajectory per version.

``rollout_group("g1", ["3", "4"])`` is a completed GRPO group of two trajectories ending on
versions 3 and 4, carrying its PromptGroup in ``prompt_group`` as the rollout worker does. A failed
group's ``error_code`` is the text of ``error`` before its first ``:`` unless given.
"""

from __future__ import annotations

from typing import Any, Literal

from shared.schemas import PromptGroup, RolloutGroup, Sample


def sample(traj_id: str, version: str | None, segment_index: int = 0, reward: float = 1.0,
           n_prompt: int = 2, n_response: int = 2) -> Sample:
    """One segment: ``n_prompt`` context tokens then ``n_response`` tokens of ``version``."""
    v = version if version is not None else "-1"
    n = n_prompt + n_response
    return Sample(traj_id=traj_id, segment_index=segment_index, token_ids=list(range(1, n + 1)),
                  loss_mask=[0] * n_prompt + [1] * n_response, logprobs=[0.0] * n_prompt + [-0.5] * n_response,
                  token_versions=["-1"] * n_prompt + [v] * n_response, start_version=version,
                  end_version=version, reward=reward)


def prompt_group(group_id: str, attempt: int = 0, n_samples: int = 2, enqueued_at: float = 100.0,
                 meta: dict[str, Any] | None = None) -> PromptGroup:
    return PromptGroup(group_id=group_id, prompt_id=f"p-{group_id}", task="reverse", prompt="reverse 12",
                       reference="21", n_samples=n_samples, attempt=attempt, enqueued_at=enqueued_at,
                       meta=meta or {})


def rollout_group(group_id: str, versions: list[str | None], attempt: int = 0,
                  status: Literal["completed", "failed"] = "completed", error: str | None = None,
                  error_code: str | None = None, retryable: bool = True, with_prompt: bool = True,
                  started: float | None = 101.0, finished: float | None = 103.0) -> RolloutGroup:
    """A group with one trajectory per entry of ``versions`` (its end version)."""
    meta: dict[str, Any] = {}
    prompt = prompt_group(group_id, attempt, n_samples=max(1, len(versions))) if with_prompt else None
    if status == "failed" and error_code is None and error:
        error_code = error.split(":", 1)[0]
    if started is not None:
        meta["rollout_started_at"] = started
    if finished is not None:
        meta["rollout_finished_at"] = finished
    samples = [sample(f"{group_id}-a{attempt}-t{i}", v) for i, v in enumerate(versions)]
    return RolloutGroup(group_id=group_id, prompt_id=f"p-{group_id}", attempt=attempt, status=status,
                        error=error, error_code=error_code, retryable=retryable, prompt_group=prompt,
                        samples=samples, meta=meta)
