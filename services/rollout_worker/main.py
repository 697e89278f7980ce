"""``dressage rollout-worker [--config FILE] [--burst]``: wiring only (config, clients, core object, run)."""

from __future__ import annotations

import argparse
import logging
import os

from prometheus_client import start_http_server

from services.rollout_worker.agents import check_agent_command
from services.rollout_worker.metrics import PORT_OFFSET
from services.rollout_worker.proxy_client import HttpProxyClient
from services.rollout_worker.runner import GroupRunner
from services.rollout_worker.worker import SERVICE, RolloutWorker
from shared.config import load_config
from shared.errors import ConfigError, RedisAuthFailed
from shared.lifecycle import StopFlag
from shared.logs import setup_logging
from shared.retry import check_redis
from shared.streams import consumer_name

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dressage rollout-worker", description=__doc__)
    parser.add_argument("--config", help="deployment YAML (default: built-in defaults + env overrides)")
    parser.add_argument("--burst", action="store_true", help="process what is in the stream, then exit 0")
    parser.add_argument("--consumer", help="consumer name (default: <hostname>-<pid>)")
    parser.add_argument("--replica", type=int, default=int(os.environ.get("DRESSAGE_REPLICA", "0")),
                        help="replica index, offsets the Prometheus port")
    args = parser.parse_args(argv)
    setup_logging(SERVICE)
    try:
        cfg = load_config(args.config)
        check_agent_command(cfg.rollout.agent_command)
        check_redis(cfg.redis.client(), backoff_max_s=cfg.redis.reconnect_backoff_max_s)  # bad password: exit now
    except (ConfigError, RedisAuthFailed) as exc:
        log.error("%s", exc)
        return 2
    consumer = args.consumer or consumer_name(SERVICE)
    if cfg.ops.metrics_port_base:
        start_http_server(cfg.ops.metrics_port_base + PORT_OFFSET + args.replica)
    key = cfg.rollout.proxy_api_key.get_secret_value() if cfg.rollout.proxy_api_key else None
    proxy = HttpProxyClient(cfg.rollout.proxy_url, key, timeout_s=cfg.rollout.trajectory_timeout_s)
    runner = GroupRunner(proxy, cfg.rollout, consumer)
    worker = RolloutWorker(cfg.redis.client(), cfg.keys(), cfg.rollout, runner, consumer, StopFlag().install(),
                           heartbeat_ttl_s=cfg.ops.heartbeat_ttl_s, backoff_max_s=cfg.redis.reconnect_backoff_max_s)
    log.info("rollout-worker starting consumer=%s proxy=%s burst=%s", consumer, cfg.rollout.proxy_url, args.burst)
    return worker.run(burst=args.burst)
