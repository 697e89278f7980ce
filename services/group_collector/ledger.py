"""Commits the collector's actions to Redis, each in ONE MULTI/EXEC (the collector's Redis shell).

For every action the transaction holds: the output XADD (batch / re-enqueued prompt / dead
letter), the XACK of its rollout entries, ``SADD {p}:collector:done`` of their
``group_id:attempt``, ``SADD {p}:collector:closed`` of the groups it trains or dead-letters, and
the ``HINCRBY {p}:stats`` counters. It runs under WATCH of the two sets and first checks that none
of its keys already has an outcome — so two collectors holding the same entry (a reclaim race, a
paused collector) can never both batch it: the second one gets the keys back and discards them.

``{p}:collector:done``  set of ``group_id:attempt`` with an outcome (the dedup key);
``{p}:collector:closed`` set of ``group_id`` trained or dead-lettered: later attempts are discarded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import redis

from services.group_collector.outcomes import (
    Action,
    Arrival,
    BatchOut,
    DeadLetterOut,
    Discard,
    Reenqueue,
)
from shared import stats
from shared.codec import encode_entry
from shared.keys import GROUP_COLLECTOR, Keys

log = logging.getLogger(__name__)


class Ledger:
    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.keys = r, keys
        self.done_key = keys.collector_done
        self.closed_key = keys.collector_closed
        self.stats_key = stats.key(keys)

    def lookup(self, arrivals: Sequence[Arrival]) -> tuple[list[bool], list[bool]]:
        """For each arrival: is its ``group_id:attempt`` done, is its group closed?"""
        if not arrivals:
            return [], []
        pipe = self.r.pipeline(transaction=False)
        pipe.smismember(self.done_key, [a.key for a in arrivals])
        pipe.smismember(self.closed_key, [a.group.group_id for a in arrivals])
        done, closed = pipe.execute()
        return [bool(x) for x in done], [bool(x) for x in closed]

    def _already(self, pipe: redis.client.Pipeline, action: Action) -> set[str]:
        arrivals = action.arrivals
        done = pipe.smismember(self.done_key, [a.key for a in arrivals])
        closed = pipe.smismember(self.closed_key, [a.group.group_id for a in arrivals])
        return {a.key for a, d, c in zip(arrivals, done, closed, strict=True) if d or c}

    def _output(self, pipe: redis.client.Pipeline, action: Action) -> None:
        if isinstance(action, BatchOut):
            pipe.xadd(self.keys.batches, encode_entry(action.batch))
        elif isinstance(action, Reenqueue):
            pipe.xadd(self.keys.prompts, encode_entry(action.prompt))
        elif isinstance(action, DeadLetterOut):
            a = action.arrival  # its counters are the action's stats (below)
            stats.add_dead_letter(pipe, self.keys, action.reason, action.error, self.keys.rollouts, a.entry_id,
                                  a.fields, None)

    def _bookkeeping(self, pipe: redis.client.Pipeline, action: Action) -> None:
        pipe.xack(self.keys.rollouts, GROUP_COLLECTOR, *[a.entry_id for a in action.arrivals])
        if action.done_keys:
            pipe.sadd(self.done_key, *action.done_keys)
        if action.closed_ids:
            pipe.sadd(self.closed_key, *action.closed_ids)
        for name, n in action.stats.items():
            pipe.hincrby(self.stats_key, name, n)

    def commit(self, action: Action) -> set[str]:
        """Commit ``action``; returns the keys that already had an outcome (then nothing is written)."""
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    if not isinstance(action, Discard):
                        pipe.watch(self.done_key, self.closed_key)
                        already = self._already(pipe, action)
                        if already:
                            pipe.reset()
                            return already
                    pipe.multi()
                    self._output(pipe, action)
                    self._bookkeeping(pipe, action)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue  # another collector committed meanwhile: check again
        _log(action)
        return set()

    def poison(self, entry_id: bytes, fields: Mapping[bytes, bytes], reason: str, error: str) -> None:
        """Dead-letter an undecodable rollout entry (``malformed`` / ``unsupported_schema``) with its ack and counter."""
        pipe = self.r.pipeline(transaction=True)
        stats.add_dead_letter(pipe, self.keys, reason, error, self.keys.rollouts, entry_id, fields,
                              stats.POISON_DEAD_LETTERED)
        pipe.xack(self.keys.rollouts, GROUP_COLLECTOR, entry_id)
        pipe.execute()
        log.warning("dead-lettered poison entry_id=%s reason=%s error=%s", entry_id.decode(), reason, error[:300])


def _log(action: Action) -> None:
    if isinstance(action, BatchOut):
        b = action.batch
        log.info("batch batch_id=%s groups=%s trainer_version=%s window=%s..%s", b.batch_id,
                 ",".join(f"{a.group.group_id}:{a.group.attempt}" for a in action.members), b.trainer_version,
                 b.window.cutoff_version, b.window.current_version)
        return
    a = action.arrival
    ids = f"group_id={a.group.group_id} attempt={a.group.attempt} entry_id={a.entry_id.decode()}"
    if isinstance(action, Reenqueue):
        log.info("re-enqueued (%s) %s as attempt=%d", action.why, ids, action.prompt.attempt)
    elif isinstance(action, DeadLetterOut):
        log.warning("dead-lettered %s reason=%s error=%s", ids, action.reason, action.error[:300])
    else:
        log.info("discarded duplicate (%s) %s", action.why, ids)
