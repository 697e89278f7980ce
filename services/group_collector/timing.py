"""Where a batch's staleness comes from, in seconds (pure): time in flight vs time waiting.

For each group of a batch, from the timestamps the pipeline leaves in it:
``enqueued_at`` (of the group's ``prompt_group``), ``meta["rollout_started_at"]`` and
``meta["rollout_finished_at"]`` (set by the rollout worker), and the batch's assembly time:

* ``staleness/time_in_flight_s``  = rollout finished − enqueued (prompt queue + rollout);
* ``staleness/time_prompt_queue_s`` = rollout started − enqueued (waiting for a worker);
* ``staleness/time_rollout_s``    = rollout finished − started;
* ``staleness/time_waiting_s``    = batch assembled − rollout finished (waiting in the collector).

Each is reported as ``_min``/``_max``/``_mean`` over the groups that carry the needed timestamps.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.schemas import RolloutGroup


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _summary(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"{name}_min": min(values), f"{name}_max": max(values), f"{name}_mean": sum(values) / len(values)}


def timing_metrics(groups: Iterable[RolloutGroup], batched_at: float) -> dict[str, float]:
    spans: dict[str, list[float]] = {"in_flight": [], "prompt_queue": [], "rollout": [], "waiting": []}
    for g in groups:
        enqueued = g.prompt_group.enqueued_at if g.prompt_group is not None else None
        started = _number(g.meta.get("rollout_started_at"))
        finished = _number(g.meta.get("rollout_finished_at"))
        if enqueued is not None and finished is not None:
            spans["in_flight"].append(finished - enqueued)
        if enqueued is not None and started is not None:
            spans["prompt_queue"].append(started - enqueued)
        if started is not None and finished is not None:
            spans["rollout"].append(finished - started)
        if finished is not None:
            spans["waiting"].append(batched_at - finished)
    out: dict[str, float] = {}
    for name, values in spans.items():
        out.update(_summary(f"staleness/time_{name}_s", values))
    return out
