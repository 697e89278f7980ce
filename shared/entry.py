"""The common start of every service: arguments, logging, config, a Redis login check.

``run_service`` parses ``--config``/``--burst`` (plus a service's own flags), sets up logging, loads and
validates the config, checks that Redis accepts our credentials (services that use it), then asks the service's ``build``
for its runner and runs it. A start-up error (bad config value, wrong password, missing dataset or
model — whatever ``expected`` names) is logged in one line and exits 2; nothing half-starts.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from typing import Any

from shared.config import DressageConfig, load_config
from shared.errors import ConfigError, RedisAuthFailed
from shared.logs import setup_logging
from shared.retry import check_redis

log = logging.getLogger(__name__)

Build = Callable[[DressageConfig, argparse.Namespace], Callable[[], int]]


def service_parser(service: str, doc: str | None, burst_help: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"dressage {service}", description=doc)
    parser.add_argument("--config", default=None, help="deployment YAML (default: built-in defaults + env overrides)")
    if burst_help is not None:  # an HTTP service has no burst mode
        parser.add_argument("--burst", action="store_true", help=burst_help)
    return parser


def run_service(service: str, argv: Sequence[str] | None, build: Build, *, doc: str | None, burst_help: str | None,
                expected: tuple[type[BaseException], ...] = (),
                extra_args: Callable[[argparse.ArgumentParser], None] | None = None,
                overrides: Callable[[argparse.Namespace], dict[str, dict[str, Any]]] | None = None,
                uses_redis: bool = True) -> int:
    """``overrides`` turns flags into config overrides (validated like the YAML); ``uses_redis=False``
    skips the Redis login check and the password policy (the engine never talks to Redis, so a
    deployment gives it no Redis password)."""
    parser = service_parser(service, doc, burst_help)
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args(argv)
    setup_logging(service)
    start_errors: tuple[type[BaseException], ...] = (ConfigError, RedisAuthFailed, *expected)
    try:
        extra = overrides(args) if overrides is not None else {}
        if not uses_redis:
            extra = {**extra, "redis": {**extra.get("redis", {}), "require_password": False}}
        cfg = load_config(args.config, overrides=extra)
        if uses_redis:
            check_redis(cfg.redis.client(), backoff_max_s=cfg.redis.reconnect_backoff_max_s)  # bad password: exit now
        runner = build(cfg, args)
    except start_errors as exc:
        log.error("cannot start: %s", exc)
        return 2
    return runner()
