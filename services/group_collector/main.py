"""``dressage group-collector [--config PATH] [--burst]``: wiring only (config, clients, core, run)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from services.group_collector.collector import SERVICE, GroupCollector
from services.group_collector.core import CollectorCore
from shared.config import DressageConfig
from shared.entry import run_service
from shared.lifecycle import StopFlag
from shared.staleness import StalenessGroupFilter, StalenessTracker, config_from_value
from shared.streams import consumer_name
from shared.telemetry import MetricGauges, prometheus_port


def build(cfg: DressageConfig, args: argparse.Namespace) -> Callable[[], int]:
    tracker = StalenessTracker(config_from_value(cfg.staleness.keep_versions))
    core = CollectorCore(StalenessGroupFilter(tracker, "collector"), cfg.train.groups_per_batch,
                         cfg.rollout.max_retries)
    c = cfg.collector
    port = prometheus_port(cfg.ops.metrics_port_base, SERVICE)
    return GroupCollector(cfg.redis.client(), cfg.keys(), core, consumer=consumer_name(SERVICE),
                          default_keep_versions=cfg.staleness.keep_versions,
                          order_by_published=cfg.staleness.order_by_published,
                          max_ready_batches=c.max_ready_batches, claim_idle_ms=c.claim_idle_ms,
                          block_ms=c.block_ms, read_count=c.read_count, control_poll_s=c.control_poll_s,
                          trim_interval_s=c.trim_interval_s, metrics_interval_s=c.metrics_interval_s,
                          burst=args.burst, heartbeat_ttl_s=cfg.ops.heartbeat_ttl_s,
                          redis_factory=cfg.redis.client, stop=StopFlag().install(),
                          gauges=None if args.burst else MetricGauges(port),
                          backoff_max_s=cfg.redis.reconnect_backoff_max_s).run


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build, doc=__doc__, burst_help="process the rollouts available now, then exit 0")
