"""The worker's Redis transactions: each outcome of a prompt entry is ONE MULTI/EXEC with its XACK.

* handed off (completed or failed): XADD the rollout group to ``{p}:rollouts`` + XACK
  (``shared.streams.handoff``) — what happens to a failed group is the collector's decision;
* poison (an entry that does not decode): XADD the dead letter + HINCRBY ``poison_dead_lettered`` + XACK.
A crash before EXEC leaves the entry pending (it is redone); after EXEC it is done exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from shared import stats
from shared.codec import encode_entry
from shared.keys import GROUP_ROLLOUT, Keys
from shared.schemas import RolloutGroup
from shared.streams import handoff


def still_pending(r: redis.Redis, keys: Keys, entry_id: bytes) -> bool:
    """True while nobody has acknowledged the prompt entry (a reclaimer may have finished it first)."""
    return bool(r.xpending_range(keys.prompts, GROUP_ROLLOUT, min=entry_id, max=entry_id, count=1))


def commit_handoff(r: redis.Redis, keys: Keys, entry_id: bytes, group: RolloutGroup) -> bytes:
    """Hand the attempt's rollout group (completed or failed) to the collector, acking its prompt."""
    return handoff(r, keys.prompts, GROUP_ROLLOUT, entry_id, keys.rollouts, encode_entry(group))


def commit_poison(r: redis.Redis, keys: Keys, entry_id: bytes, fields: Mapping[Any, Any],
                  reason: str, error: str) -> None:
    pipe = r.pipeline(transaction=True)
    stats.add_dead_letter(pipe, keys, reason, error, keys.prompts, entry_id, fields, stats.POISON_DEAD_LETTERED)
    pipe.xack(keys.prompts, GROUP_ROLLOUT, entry_id)
    pipe.execute()
