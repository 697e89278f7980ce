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
    tracker = StalenessTracker(config_from_value(cfg.staleness.keep_versions, cfg.staleness.mode))
    core = CollectorCore(StalenessGroupFilter(tracker, "collector"), cfg.train.groups_per_batch,
                         cfg.rollout.max_retries)
    port = prometheus_port(cfg.ops.metrics_port_base, SERVICE)
    return GroupCollector(cfg.redis.client(), cfg.keys(), core, cfg.collector, cfg.staleness,
                          consumer=consumer_name(SERVICE), burst=args.burst, heartbeat_ttl_s=cfg.ops.heartbeat_ttl_s,
                          backoff_max_s=cfg.redis.reconnect_backoff_max_s, redis_factory=cfg.redis.client,
                          stop=StopFlag().install(), gauges=None if args.burst else MetricGauges(port)).run


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build, doc=__doc__, burst_help="process the rollouts available now, then exit 0")
