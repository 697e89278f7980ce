"""The worker's Redis transactions: each outcome of a prompt entry is ONE MULTI/EXEC with its XACK.

* completed: XADD the rollout group to ``{p}:rollouts`` + XACK (``shared.streams.handoff``);
* failed: XADD attempt + 1 to ``{p}:prompts`` + HINCRBY ``groups_reenqueued`` — or XADD the dead
  letter to ``{p}:dead`` + HINCRBY ``groups_dead_lettered`` — plus XADD the ``failed`` rollout group
  (``meta.handled`` set) to ``{p}:rollouts``, plus XACK;
* poison: XADD the dead letter (reason ``malformed``) + HINCRBY ``poison_dead_lettered`` + XACK.
A crash before EXEC leaves the entry pending (it is redone); after EXEC it is done exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from services.rollout_worker.retry import RetryDecision
from shared.codec import encode_entry
from shared.keys import GROUP_ROLLOUT, Keys
from shared.schemas import RolloutGroup
from shared.streams import dead_letter_fields, handoff

DEAD_MAXLEN = 100_000  # {p}:dead has no consumer group; cap it approximately like shared.streams
REASON_MALFORMED = "malformed"


def stats_key(keys: Keys) -> str:
    """``{p}:stats``: pipeline counters, each bumped inside the MULTI of the operation it counts."""
    return keys.custom("stats")


def still_pending(r: redis.Redis, keys: Keys, entry_id: bytes) -> bool:
    """True while nobody has acknowledged the prompt entry (a reclaimer may have finished it first)."""
    return bool(r.xpending_range(keys.prompts, GROUP_ROLLOUT, min=entry_id, max=entry_id, count=1))


def commit_completed(r: redis.Redis, keys: Keys, entry_id: bytes, group: RolloutGroup) -> bytes:
    return handoff(r, keys.prompts, GROUP_ROLLOUT, entry_id, keys.rollouts, encode_entry(group))


def commit_failure(r: redis.Redis, keys: Keys, entry_id: bytes, fields: Mapping[Any, Any],
                   decision: RetryDecision, failed: RolloutGroup) -> None:
    pipe = r.pipeline(transaction=True)
    if decision.next_group is not None:
        pipe.xadd(keys.prompts, encode_entry(decision.next_group))  # type: ignore[arg-type]
        pipe.hincrby(stats_key(keys), "groups_reenqueued", 1)
    else:
        letter = dead_letter_fields(decision.reason or "failed", decision.error, keys.prompts, entry_id, fields)
        pipe.xadd(keys.dead, letter, maxlen=DEAD_MAXLEN, approximate=True)  # type: ignore[arg-type]
        pipe.hincrby(stats_key(keys), "groups_dead_lettered", 1)
    pipe.xadd(keys.rollouts, encode_entry(failed))  # type: ignore[arg-type]
    pipe.xack(keys.prompts, GROUP_ROLLOUT, entry_id)
    pipe.execute()


def commit_poison(r: redis.Redis, keys: Keys, entry_id: bytes, fields: Mapping[Any, Any], error: str) -> None:
    pipe = r.pipeline(transaction=True)
    pipe.xadd(keys.dead, dead_letter_fields(REASON_MALFORMED, error, keys.prompts, entry_id, fields),  # type: ignore[arg-type]
              maxlen=DEAD_MAXLEN, approximate=True)
    pipe.hincrby(stats_key(keys), "poison_dead_lettered", 1)
    pipe.xack(keys.prompts, GROUP_ROLLOUT, entry_id)
    pipe.execute()
