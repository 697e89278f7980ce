"""``dressage proxy [--config PATH] [--host H] [--port P]``: wiring only (config, tokenizer, runtime, app, serve).

One uvicorn worker: sessions, pause state and in-flight rids live in this process.
"""

from __future__ import annotations

import argparse
import gc
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.proxy.app import build_app
from services.proxy.runtime import ProxyRuntime, refuse_live_on_sglang
from shared.config import DressageConfig
from shared.entry import run_service
from shared.modeling.loading import ModelNotFound, load_tokenizer
from shared.serving import serve

log = logging.getLogger(__name__)


def proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="override proxy.host")
    p.add_argument("--port", type=int, help="override proxy.port")


def proxy_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {"proxy": {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}}


def build(cfg: DressageConfig, args: argparse.Namespace) -> Callable[[], int]:
    refuse_live_on_sglang(cfg.proxy)
    tok_path = cfg.proxy.tokenizer_path or cfg.model.path
    tokenizer = load_tokenizer(tok_path)
    runtime = ProxyRuntime(cfg.proxy, tokenizer, redis_factory=cfg.redis.client, keys=cfg.keys(),
                           heartbeat_ttl_s=cfg.ops.heartbeat_ttl_s, model_name=Path(tok_path).name or "dressage",
                           template_kwargs=cfg.model.chat_template_kwargs)
    app = build_app(runtime)

    def run() -> int:
        # Imports (torch, transformers) leave millions of long-lived objects; freezing them keeps every
        # full GC pass from re-scanning them, which otherwise shows up as latency spikes under load.
        gc.collect()
        gc.freeze()
        serve(app, cfg.proxy.host, cfg.proxy.port)  # returns on SIGTERM/SIGINT once in-flight requests were answered
        return 0

    return run


def main(argv: list[str] | None = None) -> int:
    return run_service("proxy", argv, build, doc=__doc__, burst_help=None, expected=(ModelNotFound,),
                       extra_args=proxy_args, overrides=proxy_overrides)
