"""Where a (re)starting trainer picks up: pure decisions over the checkpoint dir and the version bus.

``plan_resume(newest, published)`` decides, from the newest *complete* checkpoint version and the
latest *published* version:

| newest ckpt | published | load weights from | publish now | version counter |
|---|---|---|---|---|
| none | none | ``model.path`` | write v0 first, then publish "0" | 0 |
| none | P | P's path if complete, else ``model.path`` | nothing | P |
| C | none or P < C | C | "C" (written, never announced: crash before publish) | C |
| C | P == C | C | nothing | C |
| C | P > C | C | nothing (warns: checkpoints behind the bus) | P |

The next version is always ``counter + 1``, i.e. ``max(C, P) + 1``: versions strictly increase
across restarts and a number is never reused. Only complete checkpoints are ever considered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from services.trainer.checkpoint import CheckpointInfo
from shared.errors import DressageError
from shared.schemas import WeightVersion
from shared.versionbus import version_number

log = logging.getLogger(__name__)


class VersionFormatError(DressageError):
    """The published version is not an integer string, so the trainer cannot continue its numbering."""


def version_index(version: str) -> int:
    """The number of a published version the trainer can continue from (it publishes "0", "1", ...)."""
    number = version_number(version)
    if number is None:
        raise VersionFormatError(f"weights:latest version {version!r} is not an integer; the trainer "
                                 "publishes \"0\", \"1\", ... and cannot continue after a foreign label")
    return number


@dataclass(frozen=True)
class ResumePlan:
    weights_from: Path  # directory to load the policy weights (and tokenizer) from
    checkpoint: CheckpointInfo | None  # checkpoint whose trainer state to restore (None = fresh)
    version: int  # the current version counter; the next checkpoint is version + 1
    write_initial: bool  # nothing anywhere: write v0 from the initial weights and publish "0"
    publish: CheckpointInfo | None  # complete checkpoint to announce before training


def plan_resume(newest: CheckpointInfo | None, published: WeightVersion | None, model_path: Path,
                published_complete: bool = False) -> ResumePlan:
    """The resume decision (table in the module docstring).

    ``published_complete`` says whether the published version's directory is a complete model
    (only consulted when there is no checkpoint of our own).
    """
    p = version_index(published.version) if published is not None else None
    if newest is None:
        if p is None:
            return ResumePlan(model_path, None, -1, write_initial=True, publish=None)
        assert published is not None
        source = Path(published.path) if published_complete else model_path
        log.warning("no checkpoint in the checkpoint dir but version=%d is published; starting from %s "
                    "without optimizer state", p, source)
        return ResumePlan(source, None, p, write_initial=False, publish=None)
    c = newest.version
    if p is None or p < c:
        return ResumePlan(newest.path, newest, c, write_initial=False, publish=newest)
    if p > c:
        log.warning("published version=%d is newer than the newest checkpoint version=%d; "
                    "resuming from the checkpoint, next version=%d", p, c, p + 1)
    return ResumePlan(newest.path, newest, max(c, p), write_initial=False, publish=None)
