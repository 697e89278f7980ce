"""The eval-worker's Prometheus endpoint (``telemetry.prometheus_port(base, "eval-worker")``): what its rq worker has done.

Read from the worker at scrape time (rq keeps the counts; jobs run in forked work horses, so
nothing the job itself computes is visible here -- its results go to ``{p}:metrics`` as service
``eval``). Counters end in ``_total``, time in ``_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class EvalWorkerCollector:
    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        w = self.worker
        yield CounterMetricFamily("dressage_eval_jobs_succeeded", "Evaluation jobs finished successfully",
                                  value=float(getattr(w, "successful_job_count", 0) or 0))
        yield CounterMetricFamily("dressage_eval_jobs_failed", "Evaluation jobs that failed",
                                  value=float(getattr(w, "failed_job_count", 0) or 0))
        working = getattr(w, "total_working_time", 0) or 0
        seconds = working.total_seconds() if hasattr(working, "total_seconds") else float(working)
        yield CounterMetricFamily("dressage_eval_working_seconds", "Time spent running jobs", value=seconds)
        busy = 1.0 if getattr(w, "get_state", lambda: "")() == "busy" else 0.0
        yield GaugeMetricFamily("dressage_eval_busy", "1 while a job runs", value=busy)


def serve_metrics(worker: Any, port: int) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EvalWorkerCollector(worker))
    start_http_server(port, addr="0.0.0.0", registry=registry)
    return registry
