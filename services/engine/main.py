"""`dressage engine`: wires config, model, scheduler thread and the HTTP app, then serves.

Only wiring here: the batching logic is in `scheduler.py`, the routes in `app.py`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

import torch

from services.engine.app import EngineService, build_app
from services.engine.guard import EngineGuard
from services.engine.runner import ModelRunner
from services.engine.scheduler import Scheduler
from shared.config import DressageConfig
from shared.entry import run_service
from shared.modeling import load_model, load_tokenizer, pad_token_id, stop_token_ids
from shared.serving import serve

log = logging.getLogger(__name__)


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="override engine.host")
    p.add_argument("--port", type=int, help="override engine.port")
    p.add_argument("--model-path", help="override engine.model_path (default: model.path)")
    p.add_argument("--weight-version", help="override engine.weight_version")


def engine_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    flags = {"host": args.host, "port": args.port, "model_path": args.model_path, "weight_version": args.weight_version}
    return {"engine": {k: v for k, v in flags.items() if v is not None}}


def build_service(cfg: DressageConfig) -> EngineService:
    """Load model + tokenizer, start the scheduler thread, return the service the app wraps."""
    ec = cfg.engine
    if ec.num_threads:
        torch.set_num_threads(ec.num_threads)
    torch.manual_seed(ec.seed)
    model_path = ec.model_path or cfg.model.path
    tok = load_tokenizer(ec.tokenizer_path or model_path)
    model = load_model(model_path, device=ec.device, dtype=ec.dtype)
    eos = set(stop_token_ids(tok))
    gen_eos = model.generation_config.eos_token_id
    eos.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
    runner = ModelRunner(model, pad_token_id=pad_token_id(tok))
    sched = Scheduler(runner, weight_version=ec.weight_version, model_path=model_path,
                      max_batch_size=ec.max_batch_size, max_queue=ec.max_queue,
                      max_prefill_tokens=ec.max_prefill_tokens, seed=ec.seed,
                      admit_wait_s=ec.admit_wait_ms / 1000)
    sched.start()
    log.info("engine ready model_path=%s version=%s max_batch_size=%d threads=%d", model_path,
             ec.weight_version, ec.max_batch_size, torch.get_num_threads())
    # /update_weights_from_disk loads only the trainer's checkpoints or this engine's own model directory.
    return EngineService(sched, tok, eos_ids=eos, max_new_tokens_limit=ec.max_new_tokens_limit,
                         tokenizer_path=ec.tokenizer_path or model_path,
                         weight_roots=(cfg.train.checkpoint_dir, model_path))


def build(cfg: DressageConfig, args: argparse.Namespace) -> Callable[[], int]:
    service = build_service(cfg)
    key = cfg.engine.api_key.get_secret_value() if cfg.engine.api_key else None
    app = EngineGuard(build_app(service), key, cfg.engine.max_body_bytes)  # auth + limits before any route

    def run() -> int:
        try:
            serve(app, cfg.engine.host, cfg.engine.port)  # returns on SIGTERM/SIGINT after in-flight requests
        finally:
            service.scheduler.stop()
        return 0

    return run


def main(argv: list[str] | None = None) -> int:
    return run_service("engine", argv, build, doc="CPU engine with SGLang's HTTP API", burst_help=None,
                       extra_args=engine_args, overrides=engine_overrides, uses_redis=False)
