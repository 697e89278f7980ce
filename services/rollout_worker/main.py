"""``dressage rollout-worker [--config FILE] [--burst]``: wiring only (config, clients, core object, run)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from functools import partial

from prometheus_client import start_http_server

from services.rollout_worker.agents import check_agent_command, deny_inspection
from services.rollout_worker.proxy_client import HttpProxyClient
from services.rollout_worker.runner import GroupRunner
from services.rollout_worker.worker import SERVICE, RolloutWorker
from shared.config import DressageConfig
from shared.entry import run_service
from shared.lifecycle import StopFlag
from shared.streams import consumer_name
from shared.telemetry import prometheus_port

log = logging.getLogger(__name__)


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--consumer", help="consumer name (default: <hostname>-<pid>)")
    parser.add_argument("--replica", type=int, default=int(os.environ.get("DRESSAGE_REPLICA", "0")),
                        help="replica index, offsets the Prometheus port")


def build(cfg: DressageConfig, args: argparse.Namespace) -> Callable[[], int]:
    check_agent_command(cfg.rollout.agent_command, cfg.rollout.agent_uid)
    if cfg.rollout.agent_command and not deny_inspection():
        log.warning("this platform cannot deny same-uid inspection: agents could read the worker's environment "
                    "(set rollout.agent_uid; docs/security.md)")
    consumer = args.consumer or consumer_name(SERVICE)
    port = prometheus_port(cfg.ops.metrics_port_base, SERVICE, args.replica)
    if port is not None:
        start_http_server(port)
    key = cfg.rollout.proxy_api_key.get_secret_value() if cfg.rollout.proxy_api_key else None
    proxy = HttpProxyClient(cfg.rollout.proxy_url, key, timeout_s=cfg.rollout.trajectory_timeout_s)
    runner = GroupRunner(proxy, cfg.rollout, consumer)
    worker = RolloutWorker(cfg.redis.client(), cfg.keys(), cfg.rollout, runner, consumer, StopFlag().install(),
                           heartbeat_ttl_s=cfg.ops.heartbeat_ttl_s, backoff_max_s=cfg.redis.reconnect_backoff_max_s)
    log.info("rollout-worker starting consumer=%s proxy=%s burst=%s", consumer, cfg.rollout.proxy_url, args.burst)
    return partial(worker.run, burst=args.burst)


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build, doc=__doc__, burst_help="process what is in the stream, then exit 0",
                       extra_args=_args)
