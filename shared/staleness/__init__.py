"""Staleness: per-token weight versions (``versions``) and the batch-level version window (``window``).

``versions`` is pure arithmetic over labels, token lists and the wire models: which labels are real
versions, the spans of a sample, the partial-rollout span check, the loss mask that keeps only the
last version, and each trajectory's end version. ``window`` orders the known versions (publication
log first, then first observation) and drops a GRPO group whole when one of its trajectories ends
before the newest ``keep_versions`` (the rule itself: ``shared.window_decisions.outside_window``).
Every name below is public; nothing here does I/O.
"""

from shared.errors import InvalidSample
from shared.staleness.versions import (
    Samples,
    SpanCheck,
    TrajectoryVersionInfo,
    check_version_span,
    group_samples,
    mask_nonlast_version_tokens,
    normalize_token_versions,
    ordered_real_versions,
    sample_version_fields,
    trajectory_version_infos,
    trajectory_version_span,
    version_spans,
)
from shared.staleness.window import (
    StalenessConfig,
    StalenessConfigError,
    StalenessGroupFilter,
    StalenessTracker,
    config_from_value,
)

__all__ = [
    "InvalidSample",
    "Samples",
    "SpanCheck",
    "StalenessConfig",
    "StalenessConfigError",
    "StalenessGroupFilter",
    "StalenessTracker",
    "TrajectoryVersionInfo",
    "check_version_span",
    "config_from_value",
    "group_samples",
    "mask_nonlast_version_tokens",
    "normalize_token_versions",
    "ordered_real_versions",
    "sample_version_fields",
    "trajectory_version_infos",
    "trajectory_version_span",
    "version_spans",
]
