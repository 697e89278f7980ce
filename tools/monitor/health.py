"""``python -m tools.monitor.health SERVICE``: exit 0 when SERVICE's heartbeat key is alive.

The container healthcheck of every non-HTTP service. A service writes
``{p}:health:{service}:{consumer}`` with a TTL each loop iteration (shared.telemetry.Heartbeat);
the key expiring means the loop stopped. By default only this host's own process counts (consumer
``<hostname>-...``, or exactly ``$DRESSAGE_CONSUMER`` when set), so one healthy replica never
vouches for a hung one; ``--any`` accepts any consumer (singletons with fixed consumer names).
Exit codes: 0 healthy, 1 no live heartbeat, 2 Redis unreachable or bad config.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import redis

from shared.config import load_config
from shared.errors import ConfigError
from shared.keys import Keys


def patterns(keys: Keys, service: str, any_consumer: bool) -> str:
    if any_consumer:
        return keys.health(service, "*")
    consumer = os.environ.get("DRESSAGE_CONSUMER")
    return keys.health(service, consumer or f"{socket.gethostname()}-*")


def is_alive(r: redis.Redis, pattern: str) -> bool:
    """True when some key matches ``pattern`` and has not expired (PTTL > 0 or no TTL at all)."""
    return any(int(r.pttl(key)) != -2 for key in r.scan_iter(match=pattern, count=500))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.monitor.health", description=__doc__.splitlines()[0])
    p.add_argument("service")
    p.add_argument("--config", help="deployment config (redis.url / prefix); env overrides apply")
    p.add_argument("--any", action="store_true", help="any consumer of the service counts")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
        r = cfg.redis.client()
        ok = is_alive(r, patterns(cfg.keys(), args.service, args.any))  # hash-tagged on a cluster
    except ConfigError as exc:
        sys.stderr.write(f"health: {exc}\n")
        return 2
    except redis.RedisError as exc:
        sys.stderr.write(f"health: redis unreachable: {type(exc).__name__}\n")  # never echo the URL (password)
        return 2
    if not ok:
        sys.stderr.write(f"health: no live heartbeat for {args.service}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
