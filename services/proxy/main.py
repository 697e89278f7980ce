"""``dressage proxy [--config PATH] [--host H] [--port P]``: wiring only (config, tokenizer, runtime, app, uvicorn).

One uvicorn worker: sessions, pause state and in-flight rids live in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from services.proxy.app import build_app
from services.proxy.runtime import ProxyRuntime
from shared.config import load_config
from shared.errors import ConfigError, RedisAuthFailed
from shared.logs import setup_logging
from shared.modeling.loading import ModelNotFound, load_tokenizer
from shared.retry import check_redis

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown (exit -15); a service exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # handled: in-flight requests were answered


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dressage proxy", description=__doc__)
    p.add_argument("--config", default=None, help="deployment YAML (section `proxy`); env DRESSAGE_PROXY_* overrides")
    p.add_argument("--host", help="override proxy.host")
    p.add_argument("--port", type=int, help="override proxy.port")
    args = p.parse_args(argv)
    setup_logging("proxy")
    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    try:
        cfg = load_config(args.config, overrides={"proxy": overrides})
        tok_path = cfg.proxy.tokenizer_path or cfg.model.path
        tokenizer = load_tokenizer(tok_path)
        check_redis(cfg.redis.client(), backoff_max_s=cfg.redis.reconnect_backoff_max_s)  # bad password: exit now
    except (ConfigError, ModelNotFound, RedisAuthFailed) as exc:
        log.error("cannot start: %s", exc)
        return 2
    runtime = ProxyRuntime(cfg.proxy, tokenizer, redis_factory=cfg.redis.client, keys=cfg.keys(),
                           heartbeat_ttl_s=cfg.ops.heartbeat_ttl_s, model_name=Path(tok_path).name or "dressage")
    # Imports (torch, transformers) leave millions of long-lived objects; freezing them keeps every
    # full GC pass from re-scanning them, which otherwise shows up as latency spikes under load.
    gc.collect()
    gc.freeze()
    server = _Server(uvicorn.Config(build_app(runtime), host=cfg.proxy.host, port=cfg.proxy.port,
                                           log_level="warning", access_log=False, workers=1))
    server.run()  # returns on SIGTERM/SIGINT once in-flight requests were answered
    return 0
