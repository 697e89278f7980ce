"""``dressage window-controller [--config PATH] [--burst]``: wiring only (config, client, controller, run)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from services.window_controller.loop import SERVICE, WindowController
from shared.config import DressageConfig
from shared.entry import run_service
from shared.lifecycle import StopFlag
from shared.streams import consumer_name
from shared.telemetry import MetricGauges, prometheus_port


def build(cfg: DressageConfig, args: argparse.Namespace) -> Callable[[], int]:
    return WindowController(cfg.redis.client(), cfg.keys(), cfg.window_controller, cfg.staleness.keep_versions,
                            consumer=consumer_name(SERVICE), burst=args.burst,
                            heartbeat_ttl_s=cfg.ops.heartbeat_ttl_s, stop=StopFlag().install(),
                            backoff_max_s=cfg.redis.reconnect_backoff_max_s,
                            gauges=None if args.burst else MetricGauges(prometheus_port(cfg.ops.metrics_port_base,
                                                                                        SERVICE))).run


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build, doc=__doc__,
                       burst_help="decide once on the trainer steps already recorded, then exit 0")
