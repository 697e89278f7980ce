"""``{p}:stats``: the pipeline's counters, and the one way to dead-letter inside a pipeline's MULTI.

Every counter is bumped in the same MULTI/EXEC as the stream operation it counts, so the hash
never disagrees with the streams (docs/streams.md, "``{p}:stats`` counters"). Writers and readers
(prompt-buffer pacing, ``dressage status``, reports, the chaos checker) name the fields through
the constants below, and reach the hash through ``key``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from shared.keys import Keys
from shared.schemas import MAX_ERROR_CHARS
from shared.streams import dead_letter_fields

GROUPS_PRODUCED = "groups_produced"  # prompt-buffer: attempt-0 groups emitted
GROUPS_REENQUEUED = "groups_reenqueued"  # collector: attempt + 1 sent back to {p}:prompts
GROUPS_DEAD_LETTERED = "groups_dead_lettered"  # collector, trainer: groups given up on (not poison)
POISON_DEAD_LETTERED = "poison_dead_lettered"  # every consumer: undecodable entries
GROUPS_BATCHED = "groups_batched"  # collector
BATCHES_PRODUCED = "batches_produced"  # collector
GROUPS_TRAINED = "groups_trained"  # trainer, with the batch's XACK
BATCHES_TRAINED = "batches_trained"  # trainer
BATCHES_DEAD_LETTERED = "batches_dead_lettered"  # trainer: decodable batches it could not train
BATCHES_DUPLICATE_DISCARDED = "batches_duplicate_discarded"  # trainer: a batch_id already trained or in hand
FORGED_WEIGHTS_LATEST = "forged_weights_latest"  # trainer: weights:latest not one of its versions (the alarm)
GROUPS_DROPPED_STALE = "groups_dropped_stale"  # collector: drops by the version window
GROUPS_DUPLICATE_DISCARDED = "groups_duplicate_discarded"  # collector: late copies
REJECTED_GROUPS = "partial_rollout_rejected_groups"  # collector: failed events with the span-limit code
REJECTED_SAMPLES = "partial_rollout_rejected_samples"  # collector: their trajectories (n_samples)

DEAD_MAXLEN = 100_000  # {p}:dead has no consumer group: capped approximately


def key(keys: Keys) -> str:
    """The ``{p}:stats`` hash."""
    return keys.stats


def reenqueued_by(why: str) -> str:
    """``reenqueued:<why>`` (``stale`` / ``failed``)."""
    return f"reenqueued:{why}"


def dead_lettered_by(reason: str) -> str:
    """``dead_lettered:<reason>`` (a dead-letter reason of ``shared.codes``)."""
    return f"dead_lettered:{reason}"


def add_dead_letter(pipe: redis.client.Pipeline, keys: Keys, reason: str, error: str, source_stream: str,
                    source_id: bytes | str, fields: Mapping[Any, Any], counter: str | None) -> None:
    """Queue, in ``pipe``'s MULTI: the ``{p}:dead`` entry (original bytes, ``error`` cut to
    ``MAX_ERROR_CHARS``) and, when ``counter`` is given, its ``{p}:stats`` increment."""
    letter = dead_letter_fields(reason, error[:MAX_ERROR_CHARS], source_stream, source_id, fields)
    pipe.xadd(keys.dead, letter, maxlen=DEAD_MAXLEN, approximate=True)
    if counter is not None:
        pipe.hincrby(key(keys), counter, 1)
