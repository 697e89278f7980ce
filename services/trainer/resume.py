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

P > C is routine with ``train.checkpoint_every_versions`` > 1: versions C+1..P were published from
weights-only snapshots; their batches are still pending and are retrained from C, and P's weights
are abandoned (the next version, P + 1, replaces them on the engines).

The next version is always ``counter + 1``, i.e. ``max(C, P) + 1``: versions strictly increase
across restarts and a number is never reused. Only complete checkpoints are ever considered.

A published version counts only if it is the trainer's own (``trusted_published``): its path lies
in the trainer's checkpoint dir and is the directory of that very version (``v00000007`` for "7"). Anything
else (a forged ``{p}:weights:latest``, e.g. version 10**9 pointing at attacker weights) is refused
with an error line and the ``forged_weights_latest`` counter, and the plan uses the trainer's own
history as if nothing were published: a forgery can neither crash the trainer nor move its numbering.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from services.trainer.checkpoint import CheckpointInfo, dir_name
from shared.edge import within
from shared.schemas import WeightVersion
from shared.versions import trainer_number, version_number

log = logging.getLogger(__name__)


def trusted_published(published: WeightVersion | None, checkpoint_dir: str | Path) -> WeightVersion | None:
    """``published`` if it is one of the trainer's own versions (see the module docstring), else None."""
    if published is None:
        return None
    path = within(published.path, [checkpoint_dir])
    number = version_number(published.version)
    own = path is not None and number is not None and number >= 0 and path.name == dir_name(number)
    if not own:
        log.error("ALARM refusing {p}:weights:latest version=%r: not one of this trainer's checkpoints "
                  "(path outside train.checkpoint_dir or not matching its version); keeping the trainer's own "
                  "history", published.version[:64])
        return None
    return published


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
    p = trainer_number(published.version) if published is not None else None
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
    if p > c:  # the versions above C were snapshots (train.checkpoint_every_versions) or lost checkpoints
        log.warning("published version=%d is newer than the newest checkpoint version=%d; resuming from the "
                    "checkpoint (its pending batches are retrained), next version=%d", p, c, p + 1)
    return ResumePlan(newest.path, newest, max(c, p), write_initial=False, publish=None)
