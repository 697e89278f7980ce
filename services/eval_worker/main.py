"""``dressage eval-worker [--config PATH] [--burst]``: wiring only (config, clients, rq worker, run)."""

from __future__ import annotations

import argparse
import logging

from services.eval_worker.worker import SERVICE, build_worker, run_worker
from shared.config import load_config
from shared.errors import ConfigError, RedisAuthFailed
from shared.logs import setup_logging
from shared.retry import check_redis
from shared.streams import consumer_name

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dressage eval-worker", description=__doc__)
    parser.add_argument("--config", default=None, help="deployment YAML (default: built-in defaults)")
    parser.add_argument("--burst", action="store_true", help="run the queued evaluation jobs, then exit 0")
    args = parser.parse_args(argv)
    setup_logging(SERVICE)
    try:
        cfg = load_config(args.config)
        check_redis(cfg.redis.client(), backoff_max_s=cfg.redis.reconnect_backoff_max_s)  # bad password: exit now
    except (ConfigError, RedisAuthFailed) as exc:
        log.error("cannot start: %s", exc)
        return 2
    worker = build_worker(cfg.redis.client(), cfg.keys(), cfg.eval.queue, consumer_name(SERVICE),
                          cfg.ops.heartbeat_ttl_s)
    return run_worker(worker, args.burst)
