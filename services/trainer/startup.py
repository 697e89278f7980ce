"""Assemble a trainer from its config: checkpoint dir → resume plan → model, learner, restored state.

Order matters for crash safety: leftover temporary directories are removed *before* the newest
complete checkpoint is looked up, and only complete checkpoints are ever loaded (``checkpoint``).
The reference model for the KL term (only when ``train.kl_coef`` > 0) is the initial policy
``model.path``, frozen.

Under torchrun only rank 0 reads Redis and the checkpoint directory's state; it broadcasts its
resume plan, and every rank loads the same weights and trainer state from it (so the checkpoint
directory must be shared by all nodes of a multi-node run). Ranks > 0 get a ``Follower``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import redis
import torch

from services.trainer.checkpoint import CheckpointStore, set_rng_state
from services.trainer.follower import Follower
from services.trainer.learner import Learner
from services.trainer.loop import TrainerLoop
from services.trainer.parallel import Parallel
from services.trainer.resume import plan_resume, trusted_published
from services.trainer.sinks import MetricSinks
from shared import stats
from shared.config import DressageConfig
from shared.lifecycle import StopFlag
from shared.modeling import load_model, load_tokenizer, missing_files, pad_token_id
from shared.precision import compute_dtype, weight_dtype
from shared.telemetry import prometheus_port
from shared.versionbus import read_latest

log = logging.getLogger(__name__)



def open_trainer(cfg: DressageConfig, r: redis.Redis, stop: StopFlag | None = None,
                 with_sinks: bool = True) -> TrainerLoop | Follower:
    """A ready-to-run trainer (rank 0) or follower (ranks > 0): weights loaded, state restored, nothing announced."""
    tc = cfg.train
    parallel = Parallel.from_env(tc.device, tc.parallel, tc.dist_timeout_s)
    store = CheckpointStore(tc.checkpoint_dir)
    plan = None
    if parallel.is_leader:
        store.cleanup_temp()
        newest = store.newest()
        latest = read_latest(r, cfg.keys())
        if latest is not None and trusted_published(latest, tc.checkpoint_dir) is None:
            r.hincrby(stats.key(cfg.keys()), stats.FORGED_WEIGHTS_LATEST, 1)  # the alarm, counted
            latest = None
        plan = plan_resume(newest, latest, Path(cfg.model.path),
                           published_complete=latest is not None and not missing_files(latest.path))
        store.drop_snapshots_above(plan.version)  # numbers the next versions reuse (the bus lost them)
    plan = parallel.broadcast(plan)
    restored = store.load_state(plan.checkpoint) if plan.checkpoint is not None else None
    if restored is None:
        torch.manual_seed(tc.seed)
    device = parallel.device(tc.device)
    # train.precision: the weights in their training dtype (fp32 master weights unless bf16-pure), the
    # frozen reference in the compute dtype
    model = load_model(plan.weights_from, device=device, dtype=weight_dtype(tc.precision))
    tokenizer = load_tokenizer(plan.weights_from)
    ref_model = (load_model(cfg.model.path, device=device, dtype=compute_dtype(tc.precision))
                 if tc.kl_coef > 0 else None)
    pad_id = pad_token_id(tokenizer)
    learner = Learner(model, tc, pad_id, ref_model, parallel)
    if restored is not None:
        learner.load_state_dict(restored["learner"])
        set_rng_state(restored["rng"])
        log.info("resumed from checkpoint version=%d step=%d batches_trained=%d", plan.version,
                 learner.step, int(restored.get("batches_trained", 0)))
    else:
        log.info("starting fresh from %s (version counter=%d)", plan.weights_from, plan.version)
    if not parallel.is_leader:
        return Follower(learner)
    sinks = None
    if with_sinks:
        port = prometheus_port(cfg.ops.metrics_port_base, "trainer")
        sinks = MetricSinks(port, tc.tensorboard_dir, tc.wandb_project)
    return TrainerLoop(r, cfg, learner, tokenizer, store, plan, restored, stop or StopFlag(), sinks)
