"""``dressage trainer [--config PATH] [--burst]``: wiring only (config, clients, core, run)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

from services.trainer.loop import SERVICE
from services.trainer.parallel import run_rank
from services.trainer.startup import open_trainer
from shared.config import DressageConfig
from shared.entry import run_service
from shared.lifecycle import StopFlag
from shared.modeling import ModelNotFound


def build(cfg: DressageConfig, args: argparse.Namespace) -> Callable[[], int]:
    trainer = open_trainer(cfg, cfg.redis.client(), StopFlag().install(), with_sinks=not args.burst)
    return partial(run_rank, partial(trainer.run, burst=args.burst), trainer.learner.parallel)


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build, doc=__doc__, burst_help="train on the batches waiting now, then exit 0",
                       expected=(ModelNotFound,))
