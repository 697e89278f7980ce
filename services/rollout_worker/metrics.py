"""Prometheus instruments of the rollout worker (process-wide, default registry).

``main`` exposes them with ``prometheus_client.start_http_server`` on
``shared.telemetry.prometheus_port`` (base + offset + replica) when a base port is configured. The same events also go
to ``{p}:metrics`` via ``shared.telemetry.report_metrics`` (what ``dressage report`` reads).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.codes import STALENESS_EXCEEDED

GROUPS = Counter("dressage_rollout_groups_total", "Prompt-group attempts finished, by outcome",
                 ["outcome"])  # completed | failed | held_upstream_down | skipped_already_acked
POISON = Counter("dressage_rollout_poison_total", "Malformed prompt entries dead-lettered")
TRAJECTORIES = Counter("dressage_rollout_trajectories_total", "Trajectories of completed groups")
REJECTED_GROUPS = Counter("dressage_rollout_staleness_rejected_groups_total",
                          f"Group failures caused by {STALENESS_EXCEEDED} (once per event)")
REJECTED_SAMPLES = Counter("dressage_rollout_staleness_rejected_samples_total",
                           f"Trajectories of groups failed by {STALENESS_EXCEEDED}")
GROUP_SECONDS = Histogram("dressage_rollout_group_seconds", "Wall time of one group attempt",
                          buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
IN_FLIGHT = Gauge("dressage_rollout_in_flight_groups", "Groups this worker is rolling out now")
