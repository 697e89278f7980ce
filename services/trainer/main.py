"""``dressage trainer [--config PATH] [--burst]``: wiring only (config, clients, core, run)."""

from __future__ import annotations

import argparse
import logging

from services.trainer.loop import SERVICE
from services.trainer.startup import open_trainer
from shared.config import load_config
from shared.errors import ConfigError, RedisAuthFailed
from shared.lifecycle import StopFlag
from shared.logs import setup_logging
from shared.modeling import ModelNotFound
from shared.retry import check_redis

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dressage trainer", description=__doc__)
    parser.add_argument("--config", default=None, help="deployment YAML (default: built-in defaults)")
    parser.add_argument("--burst", action="store_true", help="train on the batches waiting now, then exit 0")
    args = parser.parse_args(argv)
    setup_logging(SERVICE)
    try:
        cfg = load_config(args.config)
        check_redis(cfg.redis.client(), backoff_max_s=cfg.redis.reconnect_backoff_max_s)  # bad password: exit now
        trainer = open_trainer(cfg, cfg.redis.client(), StopFlag().install(), with_sinks=not args.burst)
    except (ConfigError, ModelNotFound, RedisAuthFailed) as exc:
        log.error("cannot start: %s", exc)
        return 2
    return trainer.run(burst=args.burst)
