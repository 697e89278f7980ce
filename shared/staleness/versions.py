"""Per-token weight-version helpers: real versions, spans, loss masks, trajectory versions.

Pure functions over plain values and the wire models (``shared.schemas.Sample`` / ``RolloutGroup``),
shared by the proxy (sample construction, span check), the collector (window) and the trainer (mask).

One normalisation everywhere, ``shared.versions.real_version``: so ``" v1 "`` and ``"v1"`` are the
same version in every function here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from shared.codes import STALENESS_EXCEEDED
from shared.errors import InvalidSample
from shared.schemas import RolloutGroup, Sample
from shared.versions import CONTEXT_VERSION, real_version

Samples = RolloutGroup | Sequence[Sample]  # a group, or its samples

SPAN_EXCEEDED_MESSAGE = (
    "Partial rollout model version span exceeded limit; rejecting the trajectory instead of continuing it."
)


def normalize_token_versions(versions: Iterable[object]) -> list[str]:
    """Canonical per-token labels: real versions stripped, everything else ``"-1"``."""
    return [real_version(v) or CONTEXT_VERSION for v in versions]


def ordered_real_versions(versions: Iterable[object]) -> list[str]:
    """Unique real versions in order of first appearance."""
    seen: dict[str, None] = {}
    # dict.fromkeys dedupes raw labels in C first (order kept), so a 1,000-token sample costs a handful
    # of real_version calls instead of one per token. Unhashable labels fall back to the plain loop.
    items = versions if isinstance(versions, (list, tuple)) else list(versions)
    try:
        labels: Iterable[object] = dict.fromkeys(items)
    except TypeError:
        labels = items
    for v in labels:
        r = real_version(v)
        if r is not None:
            seen.setdefault(r, None)
    return list(seen)


def version_spans(token_versions: Sequence[str]) -> list[dict[str, Any]]:
    """Run-length form of ``token_versions`` (all tokens, ``"-1"`` included), half-open ``[start, end)``.

    The spans cover ``[0, len)`` contiguously and expand back to exactly ``token_versions``.
    """
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(token_versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"start": i, "end": i + 1, "version": v})
    return spans


def _check_aligned(mask: Sequence[int], versions: Sequence[object]) -> None:
    if len(mask) != len(versions):
        raise InvalidSample(f"token_versions: length {len(versions)} != len(loss_mask) {len(mask)}")
    for i, m in enumerate(mask):
        if m not in (0, 1):
            raise InvalidSample(f"loss_mask[{i}]: must be 0 or 1, got {m!r}")


def _loss_versions(mask: Sequence[int], versions: Sequence[object]) -> list[str]:
    """Real versions of the loss tokens, in token order (with repeats)."""
    _check_aligned(mask, versions)
    return [r for m, v in zip(mask, versions, strict=True) if m == 1 and (r := real_version(v)) is not None]


def mask_nonlast_version_tokens(mask: Sequence[int], versions: Sequence[object]) -> list[int]:
    """Keep loss only on tokens of the last real version when loss tokens carry several versions.

    With one (or no) real version among the loss tokens the mask is returned unchanged; otherwise
    the result is 1 exactly where ``mask`` is 1 and the token's version is the last real one
    (loss tokens with a non-real version are zeroed too).
    """
    loss = _loss_versions(mask, versions)
    if len(set(loss)) <= 1:
        return list(mask)
    last = loss[-1]
    return [1 if m == 1 and real_version(v) == last else 0 for m, v in zip(mask, versions, strict=True)]


def sample_version_fields(loss_mask: Sequence[int], token_versions: Sequence[object]) -> dict[str, Any]:
    """The version fields of a ``Sample``: spans (over normalised labels), first/last real loss
    version (None when there is none) and ``partial_rollout`` (two or more real loss versions)."""
    loss = _loss_versions(loss_mask, token_versions)
    return {
        "version_spans": version_spans(normalize_token_versions(token_versions)),
        "start_version": loss[0] if loss else None,
        "end_version": loss[-1] if loss else None,
        "partial_rollout": len(set(loss)) >= 2,
    }


@dataclass(frozen=True)
class SpanCheck:
    """Outcome of the partial-rollout version-span check for one proxy session."""

    versions: list[str]  # ordered unique real versions over the session's previous + new tokens
    version_span: int  # len(versions)
    version_switches: int  # max(0, version_span - 1)
    max_preempts: int | None  # the limit in force; None = unlimited
    max_version_span: int | None  # max_preempts + 1; None = unlimited
    exceeded: bool  # version_switches > max_preempts

    def detail(self, session_id: str) -> dict[str, Any]:
        """The HTTP 502 ``detail`` body for an exceeded span."""
        return {
            "error": STALENESS_EXCEEDED,
            "message": SPAN_EXCEEDED_MESSAGE,
            "versions": list(self.versions),
            "version_span": self.version_span,
            "version_switches": self.version_switches,
            "max_preempts": self.max_preempts,
            "max_version_span": self.max_version_span,
            "session_id": session_id,
        }


def check_version_span(
    previous: Iterable[object], candidate: Iterable[object], max_preempts: int | None
) -> SpanCheck:
    """May a session whose earlier tokens carry ``previous`` versions add ``candidate`` tokens?

    Counts distinct real versions across the whole session (turns included); ``max_preempts``
    None never rejects, a negative one is a caller bug (ValueError).
    """
    if max_preempts is not None and max_preempts < 0:
        raise ValueError(f"max_preempts must be >= 0 or None, got {max_preempts}")
    versions = ordered_real_versions([*previous, *candidate])
    switches = max(0, len(versions) - 1)
    return SpanCheck(
        versions=versions,
        version_span=len(versions),
        version_switches=switches,
        max_preempts=max_preempts,
        max_version_span=None if max_preempts is None else max_preempts + 1,
        exceeded=max_preempts is not None and switches > max_preempts,
    )


# --- reading samples and groups -------------------------------------------------------------


def group_samples(group: Samples | None) -> Sequence[Sample]:
    """The samples of a group (a ``RolloutGroup`` or its samples); none for None."""
    if group is None:
        return []
    return group.samples if isinstance(group, RolloutGroup) else group


class TrajectoryVersionInfo(NamedTuple):
    key: str  # traj_id
    version: str  # real end version of the trajectory's last versioned segment


def trajectory_version_infos(group: Samples | None) -> list[TrajectoryVersionInfo]:
    """One (traj_id, end version) per trajectory, in order of each trajectory's first sample.

    The version is the ``end_version`` of the highest ``segment_index`` among the trajectory's
    samples that have a real one; on a tie the later sample wins. Samples without a real
    ``end_version`` are skipped.
    """
    latest: dict[str, tuple[tuple[int, int], str]] = {}
    for order, sample in enumerate(group_samples(group)):
        version = real_version(sample.end_version)
        if version is None:
            continue
        pos = (sample.segment_index, order)
        key = sample.traj_id
        if key not in latest or latest[key][0] <= pos:
            latest[key] = (pos, version)
    return [TrajectoryVersionInfo(k, v) for k, (_, v) in latest.items()]


def trajectory_version_span(samples: Samples | None) -> dict[str, int]:
    """Distinct real versions per trajectory over the union of its samples' ``token_versions``."""
    per_traj: dict[str, set[str]] = {}
    for sample in group_samples(samples):
        per_traj.setdefault(sample.traj_id, set()).update(ordered_real_versions(sample.token_versions))
    return {k: len(v) for k, v in per_traj.items()}
