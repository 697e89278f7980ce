"""``dressage eval-worker [--config PATH] [--burst]``: wiring only (config, clients, rq worker, run)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from functools import partial

from services.eval_worker.admission import JobPolicy
from services.eval_worker.metrics import serve_metrics
from services.eval_worker.worker import SERVICE, build_worker, run_worker
from shared.config import DressageConfig
from shared.entry import run_service
from shared.evaluation import configure, preload, warm_up
from shared.streams import consumer_name
from shared.telemetry import prometheus_port

log = logging.getLogger(__name__)


def build(cfg: DressageConfig, args: argparse.Namespace) -> Callable[[], int]:
    configure(cfg.model.task, cfg.model.chat_template_kwargs)  # before the fork: every work horse inherits it
    modules = preload(cfg.model.path)  # inherited by every forked work horse (shared.evaluation.preload)
    warm = warm_up(cfg.model.path, cfg.eval.dataset, cfg.eval.batch_size, cfg.eval.device)
    log.info("preloaded %d modules for evaluation jobs model=%s warm=%s", len(modules), cfg.model.path, warm)
    worker = build_worker(cfg.redis.client(), cfg.keys(), cfg.eval.queue, consumer_name(SERVICE),
                          cfg.ops.heartbeat_ttl_s,
                          policy=JobPolicy(checkpoint_root=cfg.train.checkpoint_dir, data_root=cfg.eval.data_root))
    port = prometheus_port(cfg.ops.metrics_port_base, SERVICE)
    if port is not None and not args.burst:
        serve_metrics(worker, port)
    return partial(run_worker, worker, args.burst, backoff_max_s=cfg.redis.reconnect_backoff_max_s)


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build, doc=__doc__, burst_help="run the queued evaluation jobs, then exit 0")
