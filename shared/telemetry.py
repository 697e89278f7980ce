"""Heartbeats and metric reports: every service says it is alive and what it did, in Redis.

``report_metrics`` appends one entry per report to the capped ``{p}:metrics`` stream (fields:
``service``, ``ts``, then one field per metric as text), which ``dressage report`` and
``dressage status`` read back. ``heartbeat`` sets ``{p}:health:{service}:{consumer}`` with a TTL:
a service whose key expired is considered dead.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import redis

from shared.keys import Keys

log = logging.getLogger(__name__)

# Prometheus: ``ops.metrics_port_base`` + the service's offset (docs/operations.md); the engine and
# the proxy serve ``/metrics`` on their own HTTP port instead. The one table of these offsets.
PROMETHEUS_OFFSETS = {"prompt-buffer": 1, "rollout-worker": 2, "group-collector": 3, "trainer": 4, "eval-worker": 5,
                      "window-controller": 6}


# On one host (``dressage up``) rollout workers start at this offset, past every offset above, so that
# worker replicas never take another service's port; compose gives each container its own namespace instead.
LOCAL_WORKER_OFFSET = 10


def prometheus_port(base: int | None, service: str, replica: int = 0) -> int | None:
    """The Prometheus port of ``service`` (replica ``replica``), or None when no base port is set."""
    return base + PROMETHEUS_OFFSETS[service] + replica if base else None


def local_replica(worker: int) -> int:
    """The replica ``dressage up`` gives its ``worker``-th rollout worker (1-based): port base + 10 + worker - 1."""
    return LOCAL_WORKER_OFFSET - PROMETHEUS_OFFSETS["rollout-worker"] + worker - 1


def report_metrics(r: redis.Redis, keys: Keys, service: str, metrics: Mapping[str, Any],
                   maxlen: int = 100_000) -> bytes | None:
    fields: dict[str, str] = {"service": service, "ts": f"{time.time():.3f}"}
    for k, v in metrics.items():
        fields[k] = v if isinstance(v, str) else json.dumps(v)
    try:
        entry_id: bytes | None = r.xadd(keys.metrics, fields, maxlen=maxlen, approximate=True)
        return entry_id
    except redis.RedisError as exc:  # metrics are best-effort; never fail the work for them
        log.warning("metrics report failed service=%s: %s", service, exc)
        return None


def read_metrics(r: redis.Redis, keys: Keys, service: str | None = None) -> list[dict[str, Any]]:
    """All metric reports (oldest first), values parsed back from JSON where possible."""
    out: list[dict[str, Any]] = []
    for entry_id, fields in r.xrange(keys.metrics):
        row: dict[str, Any] = {"id": entry_id.decode() if isinstance(entry_id, bytes) else entry_id}
        for k, v in fields.items():
            key = k.decode() if isinstance(k, bytes) else k
            text = v.decode() if isinstance(v, bytes) else v
            try:
                row[key] = json.loads(text) if key not in ("service",) else text
            except ValueError:
                row[key] = text
        if service is None or row.get("service") == service:
            out.append(row)
    return out


def heartbeat(r: redis.Redis, keys: Keys, service: str, consumer: str, ttl_s: float = 15.0,
              info: Mapping[str, Any] | None = None) -> None:
    body = json.dumps({"service": service, "consumer": consumer, "ts": time.time(), **(info or {})})
    try:
        r.set(keys.health(service, consumer), body, px=int(ttl_s * 1000))
    except redis.RedisError as exc:
        log.warning("heartbeat failed service=%s consumer=%s: %s", service, consumer, exc)


class Heartbeat:
    """Rate-limited heartbeat for loops: ``beat()`` writes at most once per ``ttl_s / 3``."""

    def __init__(self, r: redis.Redis, keys: Keys, service: str, consumer: str, ttl_s: float = 15.0) -> None:
        self.r, self.keys, self.service, self.consumer, self.ttl_s = r, keys, service, consumer, ttl_s
        self._last = 0.0

    def beat(self, info: Mapping[str, Any] | None = None, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.ttl_s / 3:
            heartbeat(self.r, self.keys, self.service, self.consumer, self.ttl_s, info)
            self._last = now

    def clear(self) -> None:
        try:
            self.r.delete(self.keys.health(self.service, self.consumer))
        except redis.RedisError:
            pass


# Reported metrics that only grow (cumulative counts, and the trainer's cumulative seconds per phase,
# ``time/<phase>_s`` from ``shared.phases``): exposed as Prometheus counters (`_total`).
CUMULATIVE_PREFIXES = ("pipeline/", "stats/", "time/")
CUMULATIVE = frozenset({"prompt_buffer/groups_produced", "staleness/dropped_groups",
                        "staleness/partial_rollout_rejected_groups", "staleness/partial_rollout_rejected_samples"})


def is_cumulative(name: str) -> bool:
    return name in CUMULATIVE or name.startswith(CUMULATIVE_PREFIXES)


def prom_name(name: str) -> str:
    """Prometheus name of a reported metric, by the naming conventions.

    ``area/metric`` -> ``dressage_area_metric`` with the area said once
    (``train/train_rollout_logprob_abs_diff`` -> ``dressage_train_rollout_logprob_abs_diff``),
    base units spelled out (``_s`` -> ``_seconds``, ``_per_s`` -> ``_per_second``), characters
    outside ``[a-zA-Z0-9_]`` -> ``_``. Counters get ``_total`` from the client library.
    """
    area, _, metric = name.partition("/")
    if metric and (metric == area or metric.startswith(area + "_")):
        metric = metric[len(area) + 1:] if metric != area else ""
    flat = "_".join(part for part in (area, metric) if part)
    flat = "".join(c if c.isalnum() or c == "_" else "_" for c in flat)
    if flat.endswith("_per_s"):
        flat = flat[:-2] + "_second"
    elif flat.endswith("_s"):
        flat += "econds"
    return "dressage_" + flat


class MetricGauges:
    """Prometheus mirror of a service's ``report_metrics`` dict: one series per numeric metric.

    Series live in a private registry (several services or tests in one process never clash) and
    appear on first sight, named by `prom_name`; cumulative counts (`is_cumulative`) are counters
    (``..._total``), everything else gauges. ``port`` starts ``prometheus_client``'s HTTP server
    for this registry (None = no server).
    """

    def __init__(self, port: int | None = None) -> None:
        from prometheus_client import CollectorRegistry, start_http_server  # local: optional at import

        self.registry = CollectorRegistry(auto_describe=False)
        self._values: dict[str, float] = {}
        self.registry.register(_Snapshot(self._values))
        if port is not None:
            start_http_server(port, addr="0.0.0.0", registry=self.registry)

    def set(self, metrics: Mapping[str, Any]) -> None:
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._values[name] = float(value)


class _Snapshot:
    """Collector over the last reported values (read at scrape time)."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        seen: set[str] = set()
        for name, value in sorted(dict(self.values).items()):
            prom = prom_name(name)
            if prom in seen:  # two report names that map to one series: keep the first
                continue
            seen.add(prom)
            family = CounterMetricFamily if is_cumulative(name) else GaugeMetricFamily
            yield family(prom, name, value=value)
