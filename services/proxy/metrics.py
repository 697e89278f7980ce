"""Prometheus metrics of one proxy process (own registry, so several apps can live in one test process).

Labels are bounded: ``route`` is one of a fixed set of names (never a raw path: session ids
would explode cardinality), ``code`` is the HTTP status, ``reason`` a fixed error code.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SPAN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 16)


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("dressage_proxy_requests", "HTTP requests by route and status code",
                                ["route", "code"], registry=r)
        self.latency = Histogram("dressage_proxy_request_seconds", "HTTP request latency by route", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.active = Gauge("dressage_proxy_active_generations", "engine requests in flight", registry=r)
        self.suspended = Gauge("dressage_proxy_suspended_generations",
                               "preempted generations waiting for resume", registry=r)
        self.preemptions = Counter("dressage_proxy_preemptions", "engine requests interrupted by a pause",
                                   registry=r)
        self.resumes = Counter("dressage_proxy_resumed_chunks", "continuation chunks dispatched after a preemption",
                               registry=r)
        self.rejections = Counter("dressage_proxy_trajectory_rejections",
                                  "turns refused by a version check, by error code", ["reason"], registry=r)
        self.span_rejections = Counter("dressage_proxy_span_limit_rejections",
                                       "turns refused by the partial-rollout version-span limit", registry=r)
        self.version_span = Histogram("dressage_proxy_trajectory_version_span",
                                      "distinct real versions of a session after each recorded turn",
                                      buckets=SPAN_BUCKETS, registry=r)
        self.weight_updates = Counter("dressage_proxy_weight_updates", "engine weight loads by result",
                                      ["result"], registry=r)
        self.sessions = Gauge("dressage_proxy_sessions", "live sessions", registry=r)
        self.engines_behind = Gauge("dressage_proxy_engines_behind",
                                    "engines held back from routing until they serve the published weights",
                                    registry=r)
        self.stale_chunks = Counter("dressage_proxy_stale_chunks",
                                    "engine answers on weights older than the published ones (discarded, resent)",
                                    registry=r)
        self.client_disconnects = Counter("dressage_proxy_client_disconnects",
                                          "requests whose client went away before the answer", registry=r)
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}
        self.tokens = Counter("dressage_proxy_generated_tokens", "response tokens recorded", registry=r)

    def request_done(self, route: str, code: int, seconds: float) -> None:
        """Count one HTTP request (label children cached: this runs on every request)."""
        key = (route, code)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (self.requests.labels(route, str(code)), self.latency.labels(route))
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
