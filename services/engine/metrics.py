"""The engine's ``/metrics``: SGLang's load figures under Prometheus naming conventions.

Invariant: every sample is read from the scheduler at scrape time (no second bookkeeping that
could drift): gauges for what is true now (running / queued requests, KV usage, generation
throughput), ``_total`` counters for what only grows, ``_seconds`` for time. Names mirror
SGLang's (``sglang:num_running_reqs`` -> ``dressage_engine_num_running_reqs``) without the
colon, which Prometheus reserves for recording rules.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.engine.service import EngineService

P = "dressage_engine_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    def __init__(self, service: EngineService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        s = self.service.scheduler
        load = self.service.loads()
        c = s.counts()
        gauges = [
            ("num_running_reqs", "Requests in the running batch", load["num_running_reqs"]),
            ("num_queue_reqs", "Requests waiting for a prefill", load["num_waiting_reqs"]),
            ("num_used_tokens", "Tokens held in the KV cache", load["num_used_tokens"]),
            ("token_usage", "KV cache usage ratio (used tokens / max_batch_size * context length)",
             load["token_usage"]),
            ("gen_throughput", "Generated tokens per second over the last 5 s", load["gen_throughput"]),
            ("max_running_requests", "Rows of the running batch (engine.max_batch_size)", s.max_batch_size),
            ("paused", "1 while generation is paused", 1 if s.paused else 0),
            ("pending_weight_updates", "Weight updates waiting for pinned requests to finish", c["swaps_pending"]),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(P + name, doc, value=float(value))
        counters = [
            ("prompt_tokens", "Prompt tokens of accepted requests", c["prompt_tokens"]),
            ("generation_tokens", "Tokens generated", c["generated_tokens"]),
            ("requests", "Generation requests accepted", c["requests"]),
            ("finished_requests", "Generation requests finished (stop, length or abort)", c["finished"]),
            ("aborted_requests", "Generation requests aborted", c["aborted"]),
            ("prefill_passes", "Prefill forward passes", c["prefills"]),
            ("decode_steps", "Decode forward passes", c["decode_steps"]),
            ("weight_updates", "Weight swaps applied", c["swaps"]),
            ("busy_seconds", "Wall time spent computing", c["busy_s"]),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(P + name, doc, value=float(value))  # exposed as <name>_total
        info = GaugeMetricFamily(P + "weight_version_info", "Weight version being served (value 1)",
                                 labels=["weight_version"])
        info.add_metric([str(s.weight_version)], 1.0)
        yield info


def registry_for(service: EngineService) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(service))
    return reg


def scrape(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
