"""Assemble a trainer from its config: checkpoint dir → resume plan → model, learner, restored state.

Order matters for crash safety: leftover temporary directories are removed *before* the newest
complete checkpoint is looked up, and only complete checkpoints are ever loaded (``checkpoint``).
The reference model for the KL term (only when ``train.kl_coef`` > 0) is the initial policy
``model.path``, frozen.
"""

from __future__ import annotations

import logging
from pathlib import Path

import redis
import torch

from services.trainer.checkpoint import CheckpointStore, set_rng_state
from services.trainer.learner import Learner
from services.trainer.loop import TrainerLoop
from services.trainer.resume import plan_resume
from services.trainer.sinks import MetricSinks
from shared.config import DressageConfig
from shared.lifecycle import StopFlag
from shared.modeling import load_model, load_tokenizer, missing_files
from shared.versionbus import read_latest

log = logging.getLogger(__name__)

PROMETHEUS_OFFSET = 4  # ops.metrics_port_base + 4 (ARCHITECTURE: trainer)


def open_trainer(cfg: DressageConfig, r: redis.Redis, stop: StopFlag | None = None,
                 with_sinks: bool = True) -> TrainerLoop:
    """A ready-to-run trainer: weights loaded, optimizer/RNG restored, nothing announced yet."""
    tc = cfg.train
    store = CheckpointStore(tc.checkpoint_dir)
    store.cleanup_temp()
    newest = store.newest()
    latest = read_latest(r, cfg.keys())
    plan = plan_resume(newest, latest, Path(cfg.model.path),
                       published_complete=latest is not None and not missing_files(latest.path))
    restored = store.load_state(plan.checkpoint) if plan.checkpoint is not None else None
    if restored is None:
        torch.manual_seed(tc.seed)
    model = load_model(plan.weights_from, device=tc.device, dtype=tc.dtype)
    tokenizer = load_tokenizer(plan.weights_from)
    ref_model = load_model(cfg.model.path, device=tc.device, dtype=tc.dtype) if tc.kl_coef > 0 else None
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    learner = Learner(model, tc, pad_id, ref_model)
    if restored is not None:
        learner.load_state_dict(restored["learner"])
        set_rng_state(restored["rng"])
        log.info("resumed from checkpoint version=%d step=%d batches_trained=%d", plan.version,
                 learner.step, int(restored.get("batches_trained", 0)))
    else:
        log.info("starting fresh from %s (version counter=%d)", plan.weights_from, plan.version)
    sinks = None
    if with_sinks:
        port = cfg.ops.metrics_port_base + PROMETHEUS_OFFSET if cfg.ops.metrics_port_base else None
        sinks = MetricSinks(port, tc.tensorboard_dir, tc.wandb_project)
    return TrainerLoop(r, cfg, learner, tokenizer, store, plan, restored, stop or StopFlag(), sinks)
