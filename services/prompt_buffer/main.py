"""``dressage prompt-buffer [--config PATH] [--burst]``: wiring only (config, clients, core, run)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from services.prompt_buffer.brake import BrakePolicy
from services.prompt_buffer.buffer import SERVICE, PromptBuffer
from services.prompt_buffer.pacing import PacingPolicy, groups_per_version
from services.prompt_buffer.schedule import Schedule
from shared.config import DressageConfig
from shared.entry import run_service
from shared.lifecycle import StopFlag
from shared.streams import consumer_name
from shared.tasks.dataset import DatasetError, scan_dataset
from shared.telemetry import MetricGauges, prometheus_port

log = logging.getLogger(__name__)


def build(cfg: DressageConfig, args: argparse.Namespace) -> Callable[[], int]:
    dataset = scan_dataset(cfg.prompt_buffer.dataset, task=cfg.model.task)  # bad rows: logged, counted, skipped
    for err in dataset.errors:
        log.warning("dataset row skipped: %s", err)
    if dataset.skipped:
        log.warning("%d malformed row(s) of %s skipped (%d rows kept)", dataset.skipped, dataset.path, len(dataset.rows))
    if not dataset.rows:
        raise DatasetError(dataset.path, 0, "file", f"no usable rows ({dataset.skipped} malformed)")
    rows = dataset.rows
    policy = PacingPolicy(cfg.pacing.max_versions_ahead,
                          groups_per_version(cfg.train.groups_per_batch, cfg.train.update_weights_interval),
                          cfg.pacing.max_in_flight_groups)
    port = prometheus_port(cfg.ops.metrics_port_base, SERVICE)
    buffer = PromptBuffer(cfg.redis.client(), cfg.keys(), rows,
                          Schedule(len(rows), cfg.prompt_buffer.shuffle_seed, cfg.prompt_buffer.epochs), policy,
                          cfg.prompt_buffer, consumer=consumer_name(SERVICE), burst=args.burst,
                          heartbeat_ttl_s=cfg.ops.heartbeat_ttl_s, redis_factory=cfg.redis.client,
                          stop=StopFlag().install(), gauges=None if args.burst else MetricGauges(port),
                          brake=BrakePolicy(cfg.pacing.dead_letter_brake_per_min,
                                            cfg.pacing.dead_letter_brake_window_s),
                          backoff_max_s=cfg.redis.reconnect_backoff_max_s, dataset=dataset)
    return buffer.run


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build, doc=__doc__, burst_help="emit what pacing allows now, then exit 0",
                       expected=(DatasetError, OSError))
